"""One load run against an OpenAI-compatible URL, and its summary: ``appliance bench`` and each capacity probe.

The summary reports only measured-phase requests. Latency percentiles are over successful requests; the SLA
decision counts a failed request as one that missed the SLA, so errors can never make a run look faster.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

import aiohttp
from tqdm import tqdm

from appliance.exit_codes import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from appliance.loadtest.client import RequestResult, build_body, endpoint_url, monotonic_clock, stream_request
from appliance.loadtest.load import LoadRun, LoadSpec, run_load
from appliance.loadtest.prompts import Prompt
from appliance.loadtest.stats import Decision, combine, decide, summarize


class BenchError(Exception):
    """The run cannot proceed; ``exit_code`` says whether it is bad input (2) or a failure (1)."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class PromptSource(Protocol):
    """Makes request ``key``'s prompt; a source with a true ``blocking`` attribute is called in a thread."""

    def make(self, key: str | int) -> Prompt: ...


@dataclass(frozen=True)
class Target:
    """Where requests go and how they are shaped."""

    base_url: str
    model: str
    endpoint: str = "completions"
    api_key: str | None = None
    timeout_s: float = 300.0
    ignore_eos: bool = True

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def normalize_base_url(url: str) -> str:
    """``http://host:8000``, ``.../`` and ``.../v1`` all mean the same server; returns it without ``/v1``."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise BenchError(f"--url {url!r} is not an http(s) URL", EXIT_USAGE)
    path = parts.path.rstrip("/")
    path = path[: -len("/v1")] if path.endswith("/v1") else path
    return f"{parts.scheme}://{parts.netloc}{path}"


def default_metrics_url(base_url: str) -> str:
    """The appliance serves /metrics at the URL's origin."""
    parts = urlsplit(base_url)
    return f"{parts.scheme}://{parts.netloc}/metrics"


@dataclass(frozen=True)
class SLO:
    """Per-request thresholds whose P95 (``quantile``) is the SLA."""

    ttft_s: float | None = None
    e2e_s: float | None = None
    quantile: float = 0.95

    def items(self) -> list[tuple[str, float]]:
        return [(name, value) for name, value in (("ttft", self.ttft_s), ("e2e", self.e2e_s)) if value is not None]

    def as_dict(self) -> dict[str, float | None]:
        return {"ttft_p95_s": self.ttft_s, "e2e_p95_s": self.e2e_s, "quantile": self.quantile}


def meets(result: RequestResult, metric: str, threshold: float) -> bool:
    """Did this request meet one threshold? A failed request never does."""
    value = result.ttft if metric == "ttft" else result.e2e
    return result.ok and value is not None and value <= threshold


def evaluate_slo(results: Sequence[RequestResult], slo: SLO, confidence: float = 0.95,
                 min_samples: int = 30) -> dict[str, Any] | None:
    """Each SLO's decision (Wilson interval on the fraction meeting it) and the combined verdict."""
    items = slo.items()
    if not items:
        return None
    decisions: dict[str, Decision] = {}
    for metric, threshold in items:
        hits = sum(meets(r, metric, threshold) for r in results)
        decisions[metric] = decide(hits, len(results), target=slo.quantile, confidence=confidence,
                                   min_samples=min_samples)
    verdict = combine([d.verdict for d in decisions.values()])
    return {"verdict": verdict, **slo.as_dict(), "decisions": {m: d.as_dict() for m, d in decisions.items()}}


def summarize_run(run: LoadRun, slo: SLO | None = None, confidence: float = 0.95,
                  min_samples: int = 30) -> dict[str, Any]:
    """The summary of one run's measured requests over its measured window."""
    start = run.measure_start if run.measure_start is not None else 0.0
    return summarize_results(run.measured, (run.measure_end or start) - start, slo, confidence, min_samples)


def summarize_results(measured: Sequence[RequestResult], window_s: float, slo: SLO | None = None,
                      confidence: float = 0.95, min_samples: int = 30) -> dict[str, Any]:
    """Latency percentiles, throughput, goodput and errors of measured requests over ``window_s`` seconds."""
    ok = [r for r in measured if r.ok]
    window = max(window_s, 1e-9)
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    summary: dict[str, Any] = {
        "requests": len(measured), "succeeded": len(ok), "window_s": window,
        "latency_s": {
            "ttft": summarize([r.ttft for r in ok if r.ttft is not None]),
            "tpot": summarize([r.tpot for r in ok if r.tpot is not None]),
            "itl": summarize([gap for r in ok for gap in r.itl]),
            "e2e": summarize([r.e2e for r in ok if r.e2e is not None]),
            "queue": summarize([r.queue for r in measured if r.queue is not None]),
            "ttft_from_send": summarize([r.first_token - r.sent for r in ok
                                         if r.first_token is not None and r.sent is not None]),
        },
        "throughput": {
            "requests_per_s": len(ok) / window,
            "output_tokens_per_s": out_tokens / window,
            "total_tokens_per_s": (out_tokens + prompt_tokens) / window,
            "mean_in_flight": sum(r.e2e or 0.0 for r in ok) / window,
        },
        "errors": _errors(measured),
        "tokens": _tokens(ok),
    }
    sla = evaluate_slo(measured, slo, confidence, min_samples) if slo else None
    if sla is not None and slo is not None:
        good = [r for r in measured if all(meets(r, m, t) for m, t in slo.items())]
        summary["goodput"] = {"requests_per_s": len(good) / window, "fraction": len(good) / max(1, len(measured))}
    summary["sla"] = sla
    return summary


def _errors(measured: Sequence[RequestResult]) -> dict[str, Any]:
    failed = [r for r in measured if not r.ok]
    kinds = Counter((r.error or "unknown").split(":")[0] for r in failed)
    examples = list(dict.fromkeys(r.error for r in failed if r.error))[:3]
    return {"count": len(failed), "rate": len(failed) / max(1, len(measured)), "by_kind": dict(kinds),
            "examples": examples}


def _tokens(ok: Sequence[RequestResult]) -> dict[str, Any]:
    """What the server says it processed, next to what was asked: a tokenizer mismatch shows here."""
    with_usage = [r for r in ok if r.prompt_tokens is not None]
    targeted = [r for r in with_usage if r.target_prompt_tokens is not None]
    return {
        "prompt_reported": summarize([r.prompt_tokens for r in ok if r.prompt_tokens is not None]),
        "completion": summarize([r.output_tokens for r in ok]),
        "usage_reported_fraction": len(with_usage) / max(1, len(ok)),
        "prompt_target_match_fraction": (sum(r.prompt_tokens == r.target_prompt_tokens for r in targeted)
                                         / len(targeted)) if targeted else None,
        "completion_at_max_tokens_fraction": (sum(r.output_tokens == r.max_tokens for r in ok if r.max_tokens)
                                              / max(1, sum(1 for r in ok if r.max_tokens))),
    }


# --- running -------------------------------------------------------------------------------------------------


def make_session(timeout_s: float) -> aiohttp.ClientSession:
    """No connection cap: the scheduler decides concurrency, the pool must never quietly queue requests."""
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
    return aiohttp.ClientSession(connector=connector, read_bufsize=2**20,
                                 timeout=aiohttp.ClientTimeout(total=None, sock_connect=min(timeout_s, 30.0)))


async def preflight(session: aiohttp.ClientSession, target: Target) -> None:
    """Fail fast and clearly (before writing anything) on a wrong URL, key or model name."""
    url = f"{target.base_url}/v1/models"
    try:
        async with session.get(url, headers=target.headers, timeout=aiohttp.ClientTimeout(total=15)) as resp:
            if resp.status in (401, 403):
                raise BenchError(f"{url} answered {resp.status}: check --api-key", EXIT_USAGE)
            if resp.status != 200:
                return  # not every OpenAI-compatible server lists models; the run will tell
            data = await resp.json(content_type=None)
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        raise BenchError(f"cannot reach {url}: {exc or type(exc).__name__}") from exc
    except ValueError:
        return
    served = [m.get("id") for m in (data.get("data") or []) if isinstance(m, dict)] if isinstance(data, dict) else []
    if served and target.model not in served:
        raise BenchError(f"--model {target.model!r} is not served at {target.base_url}; it serves {served}",
                         EXIT_USAGE)


def make_sender(session: aiohttp.ClientSession, target: Target, prompts: PromptSource, key_prefix: str,
                clock: Callable[[], float]) -> Callable[[RequestResult], Any]:
    """The ``send`` the scheduler calls: builds request ``index``'s prompt and streams it."""
    url = endpoint_url(target.base_url, target.endpoint)

    offload = bool(getattr(prompts, "blocking", False))

    async def send(result: RequestResult) -> RequestResult:
        key = f"{key_prefix}:{result.index}" if key_prefix else result.index
        prompt = await asyncio.to_thread(prompts.make, key) if offload else prompts.make(key)
        result.target_prompt_tokens = prompt.target_tokens
        result.max_tokens = prompt.max_tokens
        body = build_body(target.model, prompt.payload(target.endpoint), prompt.max_tokens, target.ignore_eos)
        return await stream_request(session, url, body, result, clock, target.timeout_s, target.headers)

    return send


class Progress:
    """A tqdm bar on stderr: measured requests done (count mode) or measured seconds elapsed (duration mode)."""

    def __init__(self, spec: LoadSpec, label: str, enabled: bool) -> None:
        self.spec = spec
        total = spec.requests if spec.requests is not None else spec.duration
        self.bar = tqdm(total=total, desc=label, unit="req" if spec.requests is not None else "s",
                        file=sys.stderr, disable=None if enabled else True, leave=False, dynamic_ncols=True,
                        mininterval=0.5)  # disable=None: no bar when stderr is not a terminal
        self.done = 0
        self.errors = 0
        self.started = time.monotonic()

    def __call__(self, result: RequestResult) -> None:
        if result.phase != "measure":
            return
        self.done += 1
        self.errors += not result.ok
        if self.spec.requests is not None:
            self.bar.update(1)
        else:
            self.bar.n = min(self.spec.duration or 0.0, round(time.monotonic() - self.started, 1))
            self.bar.refresh()
        self.bar.set_postfix(done=self.done, errors=self.errors, refresh=False)

    def close(self) -> None:
        self.bar.close()


async def execute(target: Target, spec: LoadSpec, prompts: PromptSource, *, key_prefix: str = "",
                  progress: bool = False, label: str = "bench", check: bool = True,
                  clock: Callable[[], float] | None = None,
                  stop_when: Callable[[RequestResult], bool] | None = None) -> LoadRun:
    """Run ``spec`` against ``target`` and return the raw run (see :func:`summarize_run`)."""
    async with make_session(target.timeout_s) as session:
        if check:
            await preflight(session, target)
        clock = clock or monotonic_clock()
        bar = Progress(spec, label, progress)
        try:
            return await run_load(spec, make_sender(session, target, prompts, key_prefix, clock), clock, bar,
                                  stop_when)
        finally:
            bar.close()


def bench_report(target: Target, spec: LoadSpec, run: LoadRun, slo: SLO | None, prompt_info: dict[str, Any],
                 confidence: float = 0.95) -> dict[str, Any]:
    """The bench report: valid only when the client kept its schedule; no summary otherwise."""
    bottleneck = run.client_bottleneck()
    summary = None if bottleneck else summarize_run(run, slo, confidence)
    verdict = "invalid" if bottleneck else _bench_verdict(summary)
    return {
        "kind": "bench", "version": 1, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "target": {"url": target.base_url, "model": target.model, "endpoint": target.endpoint,
                   "ignore_eos": target.ignore_eos, "timeout_s": target.timeout_s},
        "load": {"mode": spec.mode, "concurrency": spec.concurrency, "rate": spec.rate, "requests": spec.requests,
                 "duration_s": spec.duration, "warmup": spec.warmup, "max_inflight": spec.max_inflight,
                 "seed": spec.seed},
        "prompts": prompt_info,
        "valid": bottleneck is None, "invalid_reason": bottleneck, "verdict": verdict,
        "client": run.client_report(), "summary": summary,
        "requests_completed": len(run.results), "elapsed_s": run.elapsed,
    }


def _bench_verdict(summary: dict[str, Any] | None) -> str:
    """ok; failed when nothing succeeded; the SLA verdict when SLOs were given."""
    if summary is None or summary["succeeded"] == 0:
        return "failed"
    sla = summary.get("sla")
    return "ok" if sla is None else str(sla["verdict"])


def bench_exit_code(report: dict[str, Any]) -> int:
    """1 when the run is invalid, everything failed or the SLA verdict is fail; 0 otherwise."""
    return EXIT_FAILED if report["verdict"] in ("invalid", "failed", "fail") else EXIT_OK
