"""Reports: JSON (everything), Markdown (for people), PNG plots, per-request JSONL; all written atomically.

Every file goes to a temporary file in the same folder and is renamed into place, so a crash, a Ctrl-C or a
full disk leaves either the previous file or the complete new one, never half a report that a script then
parses. The JSON report is written last and lists the other files: when it exists, they do.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from appliance.files import atomic_write_bytes, atomic_write_json, atomic_write_jsonl, atomic_write_text
from appliance.loadtest.client import RequestResult

# --- formatting ------------------------------------------------------------------------------------------------


def fmt_ms(seconds: float | None) -> str:
    """Seconds as milliseconds with one decimal; the one format Markdown uses, so tests can match it."""
    return "n/a" if seconds is None else f"{seconds * 1e3:.1f}"


def fmt_num(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _latency_table(latency: dict[str, dict[str, Any]]) -> list[str]:
    rows = ["| metric (ms) | p50 | p90 | p95 | p99 | mean | max | n |", "|---|---|---|---|---|---|---|---|"]
    for name in ("ttft", "tpot", "itl", "e2e", "queue", "ttft_from_send"):
        s = latency.get(name)
        if s is None:
            continue
        rows.append(f"| {name} | {fmt_ms(s['p50'])} | {fmt_ms(s['p90'])} | {fmt_ms(s['p95'])} | {fmt_ms(s['p99'])} "
                    f"| {fmt_ms(s['mean'])} | {fmt_ms(s['max'])} | {s['count']} |")
    return rows


def _sla_lines(sla: dict[str, Any] | None) -> list[str]:
    if not sla:
        return []
    lines = [f"SLA verdict: **{sla['verdict']}**", "", "| SLO | threshold (ms) | met | fraction | interval | verdict |",
             "|---|---|---|---|---|---|"]
    for metric, d in sla["decisions"].items():
        threshold = sla.get(f"{metric}_p95_s")
        fraction = "n/a" if d["fraction"] is None else f"{d['fraction']:.4f}"
        lines.append(f"| {metric} P{100 * sla['quantile']:g} | {fmt_ms(threshold)} | {d['successes']}/{d['n']} | "
                     f"{fraction} | [{d['lower']:.4f}, {d['upper']:.4f}] | {d['verdict']} |")
    return lines


def render_bench_markdown(report: dict[str, Any]) -> str:
    """The bench summary for people; every number also in the JSON, formatted with ``fmt_ms``/``fmt_num``."""
    load, target = report["load"], report["target"]
    offered = f"concurrency {load['concurrency']}" if load["mode"] == "closed" else f"Poisson rate {load['rate']}/s"
    size = f"{load['requests']} requests" if load["requests"] is not None else f"{load['duration_s']} s"
    lines = [f"# Bench: {target['model']} at {target['url']}", "",
             f"- load: {load['mode']} loop, {offered}, {size}, warm-up {load['warmup']} (excluded), "
             f"seed {load['seed']}",
             f"- endpoint: {target['endpoint']}; prompts: {report['prompts'].get('description', '')}",
             f"- verdict: **{report['verdict']}**"]
    if not report["valid"]:
        lines += ["", f"**Not reported: {report['invalid_reason']}.** Per-request data is in the JSONL for diagnosis."]
        return "\n".join(lines) + "\n"
    s = report["summary"]
    tp, err = s["throughput"], s["errors"]
    lines += ["", "## Latency", "", *_latency_table(s["latency_s"]), "",
              "## Throughput", "",
              f"- requests/s: {fmt_num(tp['requests_per_s'])}",
              f"- output tokens/s: {fmt_num(tp['output_tokens_per_s'])}",
              f"- total tokens/s: {fmt_num(tp['total_tokens_per_s'])}",
              f"- mean in flight: {fmt_num(tp['mean_in_flight'])}",
              f"- succeeded: {s['succeeded']}/{s['requests']}; error rate {fmt_num(err['rate'], 4)}"]
    if s.get("goodput"):
        lines.append(f"- goodput: {fmt_num(s['goodput']['requests_per_s'])} requests/s "
                     f"({fmt_num(s['goodput']['fraction'], 4)} of requests met every SLO)")
    if err["examples"]:
        lines += ["", "Errors: " + "; ".join(f"`{e}`" for e in err["examples"])]
    if s.get("sla"):
        lines += ["", "## SLA", "", *_sla_lines(s["sla"])]
    lines += ["", "## Client", "", *_client_lines(report["client"])]
    return "\n".join(lines) + "\n"


def _client_lines(client: dict[str, Any]) -> list[str]:
    def ms(key: str) -> str:
        value = client.get(key)
        return "n/a" if value is None else f"{fmt_ms(value)} ms"

    return [f"- dispatch lag P99: {ms('dispatch_lag_p99_s')}; event-loop lag P99: {ms('loop_lag_p99_s')}; "
            f"limit {ms('lag_limit_s')} (beyond it the run is not reported)"]


def _value(series: str, value: float | None) -> str:
    """A soak series value in its natural unit: latency in ms, memory in MiB, the rest as is."""
    if value is None:
        return "n/a"
    if series.endswith("_s") and not series.endswith("_per_s"):
        return f"{fmt_ms(value)} ms"
    if series.endswith("_bytes"):
        return f"{value / 2**20:.1f} MiB"
    return f"{value:.3f}"


def _change(verdict: dict[str, Any], key: str) -> str:
    """Relative changes as percentages, absolute ones (ratios) in the series' own unit."""
    value = verdict[key]
    if value is None:
        return "n/a"
    return f"{value:+.3f}" if verdict["absolute"] else f"{100 * value:+.1f}%"


def render_capacity_markdown(report: dict[str, Any]) -> str:
    """Capacity summary: the answer, every probe with its verdict and reason, the soak's drift verdicts."""
    result, slo = report["result"], report["slo"]
    slos = ", ".join(f"{m} P{100 * slo['quantile']:g} <= {fmt_ms(slo[f'{m}_p95_s'])} ms"
                     for m in ("ttft", "e2e") if slo.get(f"{m}_p95_s") is not None)
    lines = [f"# Capacity: {report['target']['model']} at {report['target']['url']}", "",
             f"- SLA: {slos}", f"- verdict: **{result['verdict']}**; max concurrency: **{result['max_concurrency']}**",
             f"- reason: {result['reason']}", "", "## Probes", "",
             "| # | C | stage | n | ttft p95 (ms) | e2e p95 (ms) | output tok/s | errors | verdict | reason |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for p in report["probes"]:
        s = p["summary"]
        lat = s["latency_s"]
        lines.append(f"| {p['id']} | {p['concurrency']} | {p['stage']} | {s['requests']} "
                     f"| {fmt_ms(lat['ttft']['p95'])} | {fmt_ms(lat['e2e']['p95'])} "
                     f"| {fmt_num(s['throughput']['output_tokens_per_s'])} "
                     f"| {s['errors']['count']} | {p['verdict']} | {p['reason']} |")
    soak = report.get("soak")
    if soak:
        lines += ["", f"## Soak at C={soak['concurrency']} for {soak['duration_s']:g} s", "",
                  f"Soak verdict: **{soak['verdict']}**" + (f" ({soak['invalid_reason']})" if soak["invalid_reason"]
                                                           else ""), "",
                  "| series | verdict | slope p | change over run | first | last | first-vs-last |",
                  "|---|---|---|---|---|---|---|"]
        for name, d in soak["drift"].items():
            p_value = "n/a" if d["p_value"] is None else f"{d['p_value']:.3g}"
            lines.append(f"| {name} | {d['verdict']} | {p_value} | {_change(d, 'trend_change')} "
                         f"| {_value(name, d['first'])} | {_value(name, d['last'])} "
                         f"| {_change(d, 'first_last_change')} |")
        if soak.get("sla"):
            lines += ["", *_sla_lines(soak["sla"])]
        if soak.get("metrics"):
            m = soak["metrics"]
            used = ", ".join(f"{key} from `{name}`" for key, name in m["metrics"].items() if name) or "no series found"
            lines += ["", f"/metrics: {m['scrapes']} scrapes ({m['failures']} failed) of {m['url']}; {used}"]
    files = report.get("files") or {}
    if files:
        lines += ["", "## Files", "", *[f"- {k}: `{v}`" for k, v in files.items()]]
    return "\n".join(lines) + "\n"


# --- plots -----------------------------------------------------------------------------------------------------


def _figure(rows: int, height: float = 3.0, sharex: bool = False) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, axes = plt.subplots(rows, 1, figsize=(9, height * rows), squeeze=False, sharex=sharex)
    return fig, [a[0] for a in axes]


def _png(fig: Any) -> bytes:
    from matplotlib import pyplot as plt

    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()


def plot_capacity(report: dict[str, Any]) -> bytes:
    """Latency percentiles vs concurrency (log2 x) per SLO metric, with the SLA line and the answer marked."""
    metrics = [m for m in ("ttft", "e2e") if report["slo"].get(f"{m}_p95_s") is not None] or ["ttft"]
    fig, axes = _figure(len(metrics), 3.4)
    probes = sorted(report["probes"], key=lambda p: (p["concurrency"], p["id"]))
    latest = sorted({p["concurrency"]: p for p in probes}.values(), key=lambda p: p["concurrency"])
    for ax, metric in zip(axes, metrics, strict=True):
        for q, style in (("p50", ":"), ("p95", "-"), ("p99", "--")):
            # lines through the last probe at each concurrency; re-runs (confirmations) as bare points
            pts = [(p["concurrency"], p["summary"]["latency_s"][metric][q]) for p in latest]
            pts = [(c, v * 1e3) for c, v in pts if v is not None]
            if pts:
                (line,) = ax.plot(*zip(*pts, strict=True), style, marker="o", label=f"{metric} {q}")
                extra = [(p["concurrency"], p["summary"]["latency_s"][metric][q]) for p in probes
                         if p not in latest]
                extra = [(c, v * 1e3) for c, v in extra if v is not None]
                if extra:
                    ax.plot(*zip(*extra, strict=True), "o", color=line.get_color(), alpha=0.4)
        for p in probes:
            v = p["summary"]["latency_s"][metric]["p95"]
            if v is not None:
                ax.annotate(p["verdict"][0].upper(), (p["concurrency"], v * 1e3), fontsize=7,
                            textcoords="offset points", xytext=(3, 3))
        threshold = report["slo"].get(f"{metric}_p95_s")
        if threshold is not None:
            ax.axhline(threshold * 1e3, color="red", linewidth=1, label=f"SLA {fmt_ms(threshold)} ms")
        found = report["result"].get("max_concurrency")
        if found:
            ax.axvline(found, color="black", linewidth=1, linestyle="-.", label=f"max C = {found}")
        ax.set_xscale("log", base=2)
        ticks = sorted({p["concurrency"] for p in probes})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("concurrency")
        ax.set_ylabel(f"{metric} (ms)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    return _png(fig)


def plot_soak(soak: dict[str, Any]) -> bytes:
    """Soak time series per window: P95 latencies, throughput, memory, KV occupancy, with drift verdicts."""
    panels = [("ttft_p95_s", "TTFT p95 (ms)", 1e3), ("e2e_p95_s", "E2E p95 (ms)", 1e3),
              ("output_tokens_per_s", "output tokens/s", 1.0), ("memory_bytes", "host memory (MiB)", 1 / 2**20),
              ("device_memory_bytes", "device memory (MiB)", 1 / 2**20),
              ("kv_usage", "KV occupancy", 1.0)]
    panels = [p for p in panels if any(w[p[0]] is not None for w in soak["windows"])]
    fig, axes = _figure(max(1, len(panels)), 2.2, sharex=True)
    minutes = soak["duration_s"] >= 120
    for ax, (key, label, scale) in zip(axes, panels, strict=False):
        pts = [(w["t_mid_s"] / (60.0 if minutes else 1.0), w[key] * scale) for w in soak["windows"]
               if w[key] is not None]
        ax.plot(*zip(*pts, strict=True), marker=".")
        verdict = soak["drift"].get(key, {}).get("verdict", "")
        ax.set_title(f"{label}: {verdict}", fontsize=9)
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel(f"{'minutes' if minutes else 'seconds'} into the soak")
    return _png(fig)


def plot_bench(results: Sequence[RequestResult], report: dict[str, Any]) -> bytes:
    """Per-request TTFT and E2E against intended send time (a stall or drift shows at once), and E2E's CDF."""
    measured = [r for r in results if r.phase == "measure" and r.ok]
    fig, axes = _figure(2, 3.0)
    if measured:
        t = [r.intended for r in measured]
        for name, colour in (("ttft", "tab:blue"), ("e2e", "tab:orange")):
            values = [getattr(r, name) * 1e3 for r in measured]
            axes[0].scatter(t, values, s=6, color=colour, label=name.upper())
            ordered = sorted(values)
            axes[1].plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], color=colour,
                         label=name.upper())
    sla = (report.get("summary") or {}).get("sla") or {}
    for key, colour in (("ttft_p95_s", "tab:blue"), ("e2e_p95_s", "tab:orange")):
        if sla.get(key) is not None:
            for ax in axes:
                (ax.axhline if ax is axes[0] else ax.axvline)(sla[key] * 1e3, color=colour, linestyle="--",
                                                             linewidth=1)
    axes[0].set_xlabel("intended send time (s)")
    axes[0].set_ylabel("latency (ms)")
    axes[1].set_xlabel("latency (ms)")
    axes[1].set_ylabel("fraction of requests")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _png(fig)


# --- whole reports ---------------------------------------------------------------------------------------------


def _plot(out: Path, files: dict[str, str], key: str, name: str, render: Callable[[], bytes]) -> None:
    """Write one PNG; without matplotlib the report says so instead of failing after the run."""
    try:
        data = render()
    except ImportError as exc:
        files.setdefault("plots_skipped", f"matplotlib is not installed ({exc})")
        return
    atomic_write_bytes(out / name, data)
    files[key] = name


def write_bench_report(out: Path, report: dict[str, Any], results: Sequence[RequestResult]) -> dict[str, str]:
    """requests.jsonl, bench.md, bench.png (only for a valid run), then bench.json listing them."""
    files = {"requests": "requests.jsonl", "markdown": "bench.md", "json": "bench.json"}
    atomic_write_jsonl(out / files["requests"], (r.as_row() for r in sorted(results, key=lambda r: r.index)))
    if report["valid"]:
        _plot(out, files, "plot", "bench.png", lambda: plot_bench(results, report))
    report["files"] = files
    atomic_write_text(out / files["markdown"], render_bench_markdown(report))
    atomic_write_json(out / files["json"], report)
    return files


def write_capacity_report(out: Path, report: dict[str, Any], rows: Sequence[dict[str, Any]]) -> dict[str, str]:
    """requests.jsonl, capacity.png, soak.png (with a soak), capacity.md, then capacity.json listing them."""
    files = {"requests": "requests.jsonl", "markdown": "capacity.md", "json": "capacity.json"}
    atomic_write_jsonl(out / files["requests"], rows)
    if report["probes"]:
        _plot(out, files, "plot", "capacity.png", lambda: plot_capacity(report))
    if report.get("soak") and report["soak"]["windows"]:
        _plot(out, files, "soak_plot", "soak.png", lambda: plot_soak(report["soak"]))
    report["files"] = files
    atomic_write_text(out / files["markdown"], render_capacity_markdown(report))
    atomic_write_json(out / files["json"], report)
    return files
