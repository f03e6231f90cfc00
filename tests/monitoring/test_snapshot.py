"""``appliance snapshot`` against a real Prometheus holding an hour of real data (no engines needed).

The data is written as OpenMetrics and turned into TSDB blocks by ``promtool tsdb create-blocks-from
openmetrics``; Prometheus (2.39+ always accepts blocks that overlap its head) then serves it like scraped data.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from appliance.engine.contract import ReplicaState
from appliance.monitoring import snapshot as snap
from appliance.monitoring.dashboards import DASHBOARDS_DIR
from tests.tools import require_tool

STEP = 15
HOUR = 3600


def openmetrics(now: int) -> str:
    """An hour of a counter, gauges and a histogram, labelled as the scrape jobs label them."""
    times = range(now - HOUR, now, STEP)
    app, engine = 'job="appliance"', 'job="vllm",replica="replica-0",model="demo"'
    lines = ["# TYPE appliance_requests counter"]
    for code, per_second in (("200", 4.0), ("503", 0.1)):
        lines += [f'appliance_requests_total{{{app},route="chat",code="{code}"}} {(t - times[0]) * per_second} {t}'
                  for t in times]
    lines.append("# TYPE appliance_request_ttft_seconds histogram")
    for t in times:
        n = (t - times[0]) * 4.0
        for le, share in (("0.1", 0.3), ("0.5", 0.8), ("0.8", 0.96), ("2.0", 0.99), ("+Inf", 1.0)):
            lines.append(f'appliance_request_ttft_seconds_bucket{{{app},route="chat",le="{le}"}} {n * share} {t}')
        lines.append(f'appliance_request_ttft_seconds_count{{{app},route="chat"}} {n} {t}')
        lines.append(f'appliance_request_ttft_seconds_sum{{{app},route="chat"}} {n * 0.3} {t}')
    lines.append("# TYPE appliance_queue_length gauge")
    lines += [f"appliance_queue_length{{{app}}} {(t // 60) % 5} {t}" for t in times]
    lines.append("# TYPE appliance_replica_state gauge")
    for state in ReplicaState:
        for t in times:
            current = "starting" if t < times[0] + 300 else "ready"
            lines.append(f'appliance_replica_state{{{app},replica="replica-0",state="{state.value}"}} '
                         f"{1 if state.value == current else 0} {t}")
    lines.append("# TYPE appliance_replica_restarts counter")
    lines += [f'appliance_replica_restarts_total{{{app},replica="replica-0"}} {1 if t > now - 600 else 0} {t}'
              for t in times]
    lines.append("# TYPE vllm:kv_cache_usage_perc gauge")
    lines += [f"vllm:kv_cache_usage_perc{{{engine}}} {0.2 + 0.5 * ((t // 60) % 10) / 10} {t}" for t in times]
    return "\n".join(lines) + "\n# EOF\n"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def loaded_prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Prometheus serving the hour above; always stopped."""
    prometheus_bin = require_tool("prometheus", "prometheus")
    promtool = require_tool("promtool", "prometheus")
    root = tmp_path_factory.mktemp("prometheus")
    data = root / "data"
    source = root / "data.om"
    source.write_text(openmetrics(int(time.time())))
    subprocess.run([promtool, "tsdb", "create-blocks-from", "openmetrics", "--quiet", str(source), str(data)],
                   check=True, capture_output=True, timeout=120)
    config = root / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 15s\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (root / "prometheus.log").open("wb")
    process = subprocess.Popen([prometheus_bin, f"--config.file={config}", f"--storage.tsdb.path={data}",
                                f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=30d"],
                               stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                pytest.fail(f"prometheus exited: {(root / 'prometheus.log').read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("prometheus not ready in 60 s")
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="appliance")
    snap.register(parser.add_subparsers())
    args = parser.parse_args(["snapshot", *argv])
    return args.handler(args)


def is_png(path: Path) -> bool:
    import matplotlib.image

    data = path.read_bytes()
    if not data.startswith(b"\x89PNG\r\n\x1a\n") or len(data) < 2000:
        return False
    height, width = matplotlib.image.imread(path).shape[:2]
    return height > 100 and width > 100


def panel_by_title(document: dict, title: str) -> dict:
    [panel] = [p for p in document["panels"] if p["title"] == title]
    return panel


def test_overview_snapshot(loaded_prometheus: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "incident" / "overview"
    assert cli("--prometheus", loaded_prometheus, "--dashboard", "appliance-overview", "--from", "-1h", "--to", "now",
               "--dashboards-dir", str(DASHBOARDS_DIR), "--out", str(out)) == 0
    assert "index.html" in capsys.readouterr().out
    board = json.loads((DASHBOARDS_DIR / "appliance-overview.json").read_text())
    shown = [p for p in board["panels"] if p["type"] != "row"]  # row headers have no queries and no image
    document = json.loads((out / "results.json").read_text())
    index = (out / "index.html").read_text()
    assert document["dashboard"] == "appliance-overview" and document["rate_interval"] == "60s"
    assert "Appliance / Service &amp; SLOs" in index
    assert [p["id"] for p in document["panels"]] == [p["id"] for p in shown]
    for panel, result in zip(shown, document["panels"], strict=True):
        assert is_png(out / result["image"]), result["image"]
        assert f'src="{result["image"]}"' in index
        assert panel["description"].replace("&", "&amp;").replace("'", "&#x27;") in index
        assert result["status"] in ("ok", "no data"), (result["title"], result["targets"])
    # Panels over the metrics we wrote have data; the rest say "no data" instead of failing.
    for title in ("Request rate", "Error ratio", "TTFT SLO attainment", "TTFT percentiles (gateway)",
                  "TTFT distribution", "Requests by route and code", "Ready replicas", "Error-budget burn rate"):
        panel = panel_by_title(document, title)
        assert panel["status"] == "ok", (title, panel["targets"])
        assert any(t["result"] for t in panel["targets"]), title
    attainment = panel_by_title(document, "TTFT SLO attainment")["targets"][0]["result"][0]["values"]
    assert abs(float(attainment[-1][1]) - 0.96) < 0.01
    heatmap = panel_by_title(document, "TTFT distribution")["targets"][0]
    assert {r["metric"]["le"] for r in heatmap["result"]} == {"0.1", "0.5", "0.8", "2.0", "+Inf"}
    for title in ("ITL percentiles (gateway)", "Tokens per second", "Engine TTFT p95 by replica (vLLM)"):
        assert panel_by_title(document, title)["status"] == "no data", title
    assert index.count('class="nodata">no data<') == sum(p["status"] == "no data" for p in document["panels"])
    # Panels appear under their row's heading, in dashboard order.
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert re.findall(r'<h2 class="row">([^<]*)</h2>', index) == rows
    assert panel_by_title(document, "TTFT distribution")["row"] == "Latency distributions"
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")], "temporary folders left behind"


def test_capacity_and_maintenance_with_variables(loaded_prometheus: str, tmp_path: Path) -> None:
    out = tmp_path / "capacity"
    document = snap.snapshot(snap.SnapshotRequest(prometheus=loaded_prometheus, dashboard="appliance-capacity", out=out,
                                                  variables={"replica": "replica-0", "model": "demo"}))
    kv = panel_by_title(document, "KV cache occupancy by replica")
    assert kv["status"] == "ok" and kv["targets"][0]["query"].endswith('replica=~"replica-0", model=~"demo"}')
    other = snap.snapshot(snap.SnapshotRequest(prometheus=loaded_prometheus, dashboard="appliance-capacity",
                                               out=tmp_path / "other", variables={"replica": "replica-9"}))
    assert panel_by_title(other, "KV cache occupancy by replica")["status"] == "no data"

    maintenance = snap.snapshot(snap.SnapshotRequest(prometheus=loaded_prometheus, dashboard="appliance-maintenance",
                                                     out=tmp_path / "maintenance", start="now-1h", step="30s"))
    states = panel_by_title(maintenance, "Replica state")["targets"][0]["result"][0]["values"]
    assert float(states[0][1]) == 2 and float(states[-1][1]) == 1  # starting, then ready
    restarts = panel_by_title(maintenance, "Restarts and crashes")
    assert restarts["status"] == "ok"
    assert is_png(tmp_path / "maintenance" / panel_by_title(maintenance, "Replica state")["image"])


def test_usage_errors_write_nothing(loaded_prometheus: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "incident" / "out"
    common = ("--out", str(out))
    assert cli("--prometheus", loaded_prometheus, "--dashboard", "no-such-board", *common) == 2
    assert "unknown dashboard 'no-such-board'" in capsys.readouterr().err
    assert cli("--prometheus", f"http://127.0.0.1:{free_port()}", "--dashboard", "appliance-overview",
               *common) == 2
    assert "cannot reach Prometheus" in capsys.readouterr().err
    assert cli("--prometheus", loaded_prometheus, "--dashboard", "appliance-overview", "--from", "now",
               "--to", "-1h", *common) == 2
    assert "empty time range" in capsys.readouterr().err
    assert cli("--prometheus", loaded_prometheus, "--dashboard", "appliance-overview", "--from", "yesterday",
               *common) == 2
    assert "bad time 'yesterday'" in capsys.readouterr().err
    assert cli("--prometheus", loaded_prometheus, "--dashboard", "appliance-overview", "--from", "-30d", "--step", "1s",
               *common) == 2
    assert "points per series" in capsys.readouterr().err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_an_earlier_snapshot_is_kept_unless_overwrite(loaded_prometheus: str, tmp_path: Path) -> None:
    out = tmp_path / "snap"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    args = ("--prometheus", loaded_prometheus, "--dashboard", "appliance-hardware", "--out", str(out))
    assert cli(*args) == 2
    assert (out / "notes.txt").read_text() == "mine"
    assert cli(*args, "--overwrite") == 0
    assert not (out / "notes.txt").exists() and (out / "index.html").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snap"]


def test_a_failing_query_is_reported_not_fatal(loaded_prometheus: str, tmp_path: Path) -> None:
    board = {"uid": "broken", "title": "Broken", "panels": [
        {"id": 1, "type": "timeseries", "title": "bad", "description": "d", "targets": [
            {"refId": "A", "expr": "sum(rate(x[$__rate_interval])) by", "legendFormat": ""}]},
        {"id": 2, "type": "stat", "title": "good", "description": "d", "fieldConfig": {"defaults": {"unit": "none"}},
         "targets": [{"refId": "A", "expr": 'appliance_queue_length{job="appliance"}', "legendFormat": ""}]}]}
    (tmp_path / "boards").mkdir()
    (tmp_path / "boards" / "whatever.json").write_text(json.dumps(board))
    assert cli("--prometheus", loaded_prometheus, "--dashboard", "broken", "--dashboards-dir", str(tmp_path / "boards"),
               "--out", str(tmp_path / "out")) == 1
    document = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [p["status"] for p in document["panels"]] == ["error", "ok"]
    assert "query error" in (tmp_path / "out" / "index.html").read_text()


# --- pure parts ------------------------------------------------------------------------------------------------------


def test_time_range_follows_grafana() -> None:
    now = 1_800_000_000.0
    span = snap.TimeRange.resolve("-1h", "now", step=None, rate_interval=None, scrape_interval=15, now=now)
    assert (span.start, span.end, span.step, span.rate_interval) == (now - 3600, now, 15, "60s")
    wide = snap.TimeRange.resolve("now-24h", "now", step=None, rate_interval=None, scrape_interval=15, now=now)
    assert wide.step == 360 and wide.rate_interval == "375s"  # max(step + scrape, 4 x scrape)
    fixed = snap.TimeRange.resolve("2027-01-15T10:00:00Z", "2027-01-15T11:00:00+00:00", step="1m",
                                   rate_interval="5m", scrape_interval=15, now=now)
    assert fixed.end - fixed.start == 3600 and fixed.step == 60 and fixed.rate_interval == "5m"
    assert snap.parse_time("1800000000", now) == 1_800_000_000
    assert snap.parse_duration("1h30m") == 5400
    with pytest.raises(snap.SnapshotError):
        snap.parse_duration("5 minutes")


def test_legend_and_units() -> None:
    labels = {"__name__": "x", "job": "appliance", "replica": "replica-0", "code": "503"}
    assert snap.legend("{{replica}} {{ code }}", labels) == "replica-0 503"
    assert snap.legend("", labels) == 'x{code="503", replica="replica-0"}'
    assert snap.format_value(0.957, "percentunit") == "95.7 %"
    assert snap.format_value(0.25, "s") == "250 ms"
    assert snap.format_value(3 * 2**30, "bytes") == "3 GiB"
    assert snap.format_value(12.5, "suffix: tok/s") == "12.5 tok/s"
    assert snap.format_value(float("nan"), "s") == "no data"
