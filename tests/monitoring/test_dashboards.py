"""The dashboards: committed files match the generator, follow the conventions, and query only valid PromQL
over metrics that exist (the gateway's, the collectors', maintenance's, or vLLM's own)."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from appliance.monitoring import dashboards
from appliance.monitoring.config import CONFIG_PATH, MonitoringConfigError, load_config, parse_config
from appliance.monitoring.promql import metric_names, rate_windows, substitute

REPO = Path(__file__).resolve().parents[2]
DIR = REPO / "dashboards"
VLLM_LOGGERS = "vllm/v1/metrics/loggers.py"
BOARDS = {uid: build() for uid, build in dashboards.DASHBOARDS.items()}
HISTOGRAM_FUNCTIONS = ("histogram_quantile",)


def content(board: dict[str, Any]) -> list[dict[str, Any]]:
    """The panels that show data: every panel but the row headers."""
    return [panel for panel in board["panels"] if panel["type"] != "row"]


def panels() -> Iterator[tuple[str, dict[str, Any]]]:
    for uid, board in BOARDS.items():
        for panel in content(board):
            yield uid, panel


def expressions() -> Iterator[tuple[str, str]]:
    """(where, expr) for every panel target, annotation and variable query."""
    for uid, board in BOARDS.items():
        for panel in content(board):
            for target in panel["targets"]:
                yield f"{uid}#{panel['id']}{target['refId']}", target["expr"]
        for annotation in board["annotations"]["list"]:
            if "expr" in annotation:
                yield f"{uid} annotation {annotation['name']}", annotation["expr"]
        for variable in board["templating"]["list"]:
            if variable["type"] == "query":
                query = variable["query"]["query"]
                inner = re.fullmatch(r"label_values\((.*),\s*\w+\)", query)
                assert inner, query
                yield f"{uid} variable {variable['name']}", inner.group(1)


# --- the files -----------------------------------------------------------------------------------------------------


def test_committed_files_match_the_generator() -> None:
    diffs = dashboards.stale(DIR)
    assert not diffs, "run python -m appliance.monitoring.dashboards --write\n" + "\n".join(diffs)[:4000]
    assert sorted(p.name for p in DIR.glob("*.json")) == sorted(f"{uid}.json" for uid in BOARDS)


def test_check_mode_reports_a_stale_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert dashboards.main(["--write", "--dir", str(tmp_path)]) == 0
    assert dashboards.main(["--check", "--dir", str(tmp_path)]) == 0
    path = tmp_path / "appliance-capacity.json"
    path.write_text(path.read_text().replace('"Appliance / Capacity"', '"edited in the UI"'))
    capsys.readouterr()
    assert dashboards.main(["--check", "--dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert '-  "title": "edited in the UI"' in out and '+  "title": "Appliance / Capacity"' in out


def test_the_slos_are_the_alert_rules(tmp_path: Path) -> None:
    """The overview measures what alerts/config.yaml pages on; a changed config changes the panels."""
    config = yaml.safe_load(CONFIG_PATH.read_text())
    slos = load_config().slos
    assert slos.ttft.threshold_seconds == config["slos"]["ttft"]["threshold_seconds"]
    assert slos.availability.objective == config["slos"]["availability"]["objective"]
    exprs = [t["expr"] for p in content(BOARDS["appliance-overview"]) for t in p["targets"]]
    assert any(f'le="{slos.ttft.threshold_seconds}"' in e for e in exprs)
    config["slos"]["ttft"]["threshold_seconds"] = 1.0
    config["slos"]["availability"]["error_code_regex"] = "5..|429"
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    changed = dashboards.DASHBOARDS["appliance-overview"](load_config(tmp_path / "config.yaml"))
    exprs = [t["expr"] for p in content(changed) for t in p["targets"]]
    assert any('le="1.0"' in e for e in exprs) and any('code=~"5..|429"' in e for e in exprs)
    with pytest.raises(MonitoringConfigError, match="absent.yaml does not exist"):
        load_config(tmp_path / "absent.yaml")


def test_provisioning() -> None:
    datasource = yaml.safe_load((DIR / "provisioning/datasources/prometheus.yaml").read_text())
    [prometheus] = datasource["datasources"]
    assert prometheus["uid"] == dashboards.DATASOURCE_UID and prometheus["type"] == "prometheus"
    assert prometheus["url"] == "${PROMETHEUS_URL}"
    provider = yaml.safe_load((DIR / "provisioning/dashboards/appliance.yaml").read_text())
    [files] = provider["providers"]
    assert files["type"] == "file" and files["folder"] == "Appliance" and files["allowUiUpdates"] is False
    assert files["options"]["path"] == "/var/lib/grafana/dashboards"


# --- conventions ---------------------------------------------------------------------------------------------------


def test_dashboards_have_stable_uids_and_no_ids() -> None:
    assert list(BOARDS) == ["appliance-overview", "appliance-capacity", "appliance-hardware",
                            "appliance-maintenance", "appliance-tenants"]
    for uid, board in BOARDS.items():
        assert board["uid"] == uid and board.get("id") is None
        assert board["schemaVersion"] == 39
        assert "appliance" in board["tags"]
    assert BOARDS["appliance-overview"]["title"] == "Appliance / Service & SLOs"


def test_panel_ids_are_unique_and_explicit() -> None:
    for uid, board in BOARDS.items():
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)), uid
        assert all(isinstance(i, int) and i > 0 for i in ids), uid


def test_panel_titles_are_unique() -> None:
    for uid, board in BOARDS.items():
        titles = [p["title"] for p in board["panels"]]
        assert len(titles) == len(set(titles)), uid


def test_panels_fit_the_grid_without_overlap() -> None:
    for uid, board in BOARDS.items():
        cells: set[tuple[int, int]] = set()
        for panel in board["panels"]:
            grid = panel["gridPos"]
            assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, (uid, panel["title"])
            mine = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                    for y in range(grid["y"], grid["y"] + grid["h"])}
            assert not mine & cells, (uid, panel["title"])
            cells |= mine


def test_every_panel_has_a_unit_and_a_description() -> None:
    for uid, panel in panels():
        where = f"{uid}: {panel['title']}"
        assert len(panel["description"]) > 20, where
        unit = panel["fieldConfig"]["defaults"].get("unit")
        assert unit, where
        if panel["type"] == "heatmap":
            assert panel["options"]["yAxis"]["unit"] == unit, where


def test_every_panel_and_target_uses_the_datasource_variable() -> None:
    for board in BOARDS.values():
        [datasource] = [v for v in board["templating"]["list"] if v["name"] == "datasource"]
        assert datasource["type"] == "datasource" and datasource["query"] == "prometheus"
        assert datasource["current"]["value"] == dashboards.DATASOURCE_UID
        for panel in content(board):
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            assert panel["targets"], panel["title"]
            for target in panel["targets"]:
                assert target["datasource"] == panel["datasource"], panel["title"]
        for variable in board["templating"]["list"]:
            if variable["type"] == "query":
                assert variable["datasource"]["uid"] == "${datasource}"
        for annotation in board["annotations"]["list"]:
            if "expr" in annotation:
                assert annotation["datasource"]["uid"] == "${datasource}"


def test_replica_and_model_variables() -> None:
    for board in BOARDS.values():
        variables = {v["name"]: v for v in board["templating"]["list"]}
        for name in ("replica", "model"):
            variable = variables[name]
            assert variable["type"] == "query" and variable["multi"] and variable["includeAll"], name
            assert variable["allValue"] == ".*"
            assert variable["query"]["query"].startswith("label_values(") and f", {name})" in variable["query"]["query"]


def test_every_rate_uses_rate_interval() -> None:
    for where, expr in expressions():
        windows = rate_windows(expr)
        assert all(w == "$__rate_interval" for w in windows), (where, expr)
        assert "irate(" not in expr, where


def test_histograms_are_shown_as_heatmaps() -> None:
    """Every latency histogram a panel takes percentiles of also has a heatmap (on some dashboard)."""
    quantiled, heatmapped = set(), set()
    for _, panel in panels():
        for target in panel["targets"]:
            histograms = {n.removesuffix("_bucket") for n in metric_names(target["expr"]) if n.endswith("_bucket")}
            if panel["type"] == "heatmap":
                assert target["format"] == "heatmap" and target["legendFormat"] == "{{le}}", panel["title"]
                assert re.match(r"sum by \(le\) \(rate\(", target["expr"]), panel["title"]
                assert panel["options"]["calculate"] is False, panel["title"]
                heatmapped |= histograms
            elif "histogram_quantile" in target["expr"]:
                quantiled |= histograms
    assert quantiled and quantiled <= heatmapped, quantiled - heatmapped


def test_annotations_for_restarts_and_maintenance() -> None:
    for board in BOARDS.values():
        exprs = {a["name"]: a.get("expr", "") for a in board["annotations"]["list"]}
        assert "appliance_replica_restarts_total" in exprs["Replica restarts"]
        assert "appliance_maintenance_actions_total" in exprs["Maintenance actions"]


def test_the_brief_is_covered() -> None:
    """Each dashboard shows what it is for (a guard against a refactor silently dropping a panel)."""
    def queried(uid: str) -> set[str]:
        return {n for panel in content(BOARDS[uid]) for t in panel["targets"] for n in metric_names(t["expr"])}

    assert {"appliance_requests_total", "appliance_request_ttft_seconds_bucket", "appliance_request_itl_seconds_bucket",
            "appliance_request_e2e_seconds_bucket", "appliance_request_queue_wait_seconds_bucket",
            "appliance_tokens_total"} <= queried("appliance-overview")
    assert {"vllm:kv_cache_usage_perc", "appliance_queue_length", "vllm:num_requests_waiting",
            "vllm:num_requests_running", "vllm:num_preemptions_total", "appliance_replica_concurrency_limit",
            "appliance_admission_rejections_total", "appliance_inflight_requests",
            "appliance_routing_decisions_total", "appliance_routing_prefix_match_ratio_bucket",
            "appliance_routing_prefix_index_bytes", "appliance_routing_prefix_yields_total",
            "appliance_routing_duration_seconds_bucket"} <= queried("appliance-capacity")
    assert {"appliance_routing_prefix_source_total", "appliance_routing_precise_fallbacks_total",
            "appliance_routing_kv_index_usable", "appliance_routing_kv_event_batches_lost_total",
            "appliance_routing_kv_event_lag_seconds", "appliance_batches", "appliance_batch_lines",
            "appliance_batch_lines_in_flight", "appliance_batch_lines_answered_total",
            "appliance_batch_lines_deferred_total", "appliance_batch_lines_given_back_total",
            "appliance_batch_tokens_total", "appliance_batch_expiry_timestamp_seconds"} <= queried("appliance-capacity")
    assert {"appliance_mbu_ratio", "appliance_mfu_ratio", "appliance_engine_resident_memory_bytes",
            "appliance_gpu_memory_used_bytes", "appliance_engine_memory_fragmentation_ratio",
            "appliance_engine_oom_total", "appliance_gpu_temperature_celsius", "appliance_gpu_power_watts",
            "appliance_collector_source"} <= queried("appliance-hardware")
    assert {"appliance_replica_state", "appliance_replica_restarts_total", "appliance_replica_crashes_total",
            "appliance_replica_model_load_seconds", "appliance_replica_last_restart_timestamp_seconds",
            "appliance_replica_spawn_failures_total",
            "appliance_maintenance_actions_total", "appliance_replica_hung",
            "appliance_maintenance_next_window_timestamp_seconds"} <= queried("appliance-maintenance")
    assert {"appliance_tenant_requests_total", "appliance_tenant_tokens_total", "appliance_tenant_ttft_seconds_bucket",
            "appliance_tenant_queue_wait_seconds_bucket", "appliance_tenant_rate_limited_total",
            "appliance_tenant_quota_remaining_ratio", "appliance_tenant_in_flight_requests",
            "appliance_tenant_queued_requests"} <= queried("appliance-tenants")


# --- PromQL validity -------------------------------------------------------------------------------------------------


def test_every_expression_is_valid_promql(tmp_path: Path, promtool: str) -> None:
    """All expressions at once, as recording rules checked by promtool (Prometheus' own parser)."""
    found = list(expressions())
    rules = [{"record": f"dashboard:check_{i}", "expr": substitute(expr)} for i, (_, expr) in enumerate(found)]
    path = tmp_path / "dashboards.rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}, sort_keys=False))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    where = "\n".join(f"check_{i}: {w}" for i, (w, _) in enumerate(found))
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{where}"
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout


def test_substitution_rejects_unknown_variables() -> None:
    assert substitute('x{a=~"$replica"}[$__rate_interval]', rate_interval="1m") == 'x{a=~".*"}[1m]'
    assert substitute('x{a=~"${model}"}', variables={"model": "demo"}) == 'x{a=~"demo"}'
    with pytest.raises(ValueError, match=r"\$replcia"):
        substitute('x{a=~"$replcia"}')


# --- metric names: the contract with the gateway, collectors, maintenance and vLLM ---------------------------------

_CONSTRUCTOR = re.compile(
    r"\b(Counter|Gauge|Histogram|Summary|CounterMetricFamily|GaugeMetricFamily|HistogramMetricFamily"
    r"|replica_counter|replica_gauge)\(\s*"
    r'(?:name=)?"(appliance_\w+)"')
_TABLE_ROW = re.compile(r'\(\s*"\w+",\s*"(appliance_\w+)",')  # the collectors' (key, metric, doc) gauge tables
_VLLM = re.compile(r'self\._(gauge|counter|histogram)_cls\(\s*name="(vllm:\w+)"')
_VLLM_INFO = re.compile(r'\bname = "(vllm:\w+_info)"')  # info metrics: a gauge set to 1, config as labels
KINDS = {"Counter": "counter", "CounterMetricFamily": "counter", "Gauge": "gauge", "GaugeMetricFamily": "gauge",
         "Histogram": "histogram", "HistogramMetricFamily": "histogram", "Summary": "summary",
         # the collectors' per-replica families (appliance.collectors.base)
         "replica_counter": "counter", "replica_gauge": "gauge"}


def appliance_catalogue() -> dict[str, str]:
    """Every ``appliance_`` metric the package defines, with its type, from the source of its modules."""
    found: dict[str, str] = {}
    for path in sorted((REPO / "appliance").rglob("*.py")):
        if "monitoring" in path.relative_to(REPO).parts:
            continue  # dashboards and rules reference metrics, they do not define them
        text = path.read_text()
        for kind, name in _CONSTRUCTOR.findall(text):
            found[name] = KINDS[kind]
        for name in _TABLE_ROW.findall(text):
            found.setdefault(name, "gauge")
    return found


def vllm_catalogue() -> dict[str, str]:
    import vllm

    text = (Path(vllm.__file__).parent / VLLM_LOGGERS.removeprefix("vllm/")).read_text()
    return {**{name: "gauge" for name in _VLLM_INFO.findall(text)},
            **{name: kind for kind, name in _VLLM.findall(text)}}


def series_names(catalogue: dict[str, str]) -> set[str]:
    """The names Prometheus stores: counters get ``_total``, histograms ``_bucket``/``_sum``/``_count``."""
    names = set()
    for name, kind in catalogue.items():
        if kind == "counter":
            names.add(name if name.endswith("_total") else f"{name}_total")
        elif kind in ("histogram", "summary"):
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"} if kind == "histogram" else \
                {name, f"{name}_sum", f"{name}_count"}
        else:
            names.add(name)
    return names


def exposed(registry: Any) -> dict[str, str]:
    return {family.name: family.type for family in registry.collect()}


def test_the_catalogue_matches_what_the_code_registers(tmp_path: Path) -> None:
    """The source scan is honest: every family the real registries expose is in it, with the same type."""
    from prometheus_client import CollectorRegistry

    from appliance.collectors import register_collectors
    from appliance.collectors.settings import CollectorSettings
    from appliance.gateway.admission.limit import ConcurrencyLimits
    from appliance.gateway.admission.queue import Admission
    from appliance.gateway.observation.fleet_metrics import FleetCollector
    from appliance.gateway.observation.metrics import RequestMetrics
    from appliance.gateway.routing.router import Router
    from appliance.maintenance.metrics import MaintenanceCollector, MaintenanceMetrics

    router = Router(list)
    registry = CollectorRegistry()
    RequestMetrics(registry, slo_ttft_seconds=0.8)
    admission = Admission(router, ConcurrencyLimits(None), max_queue=0, queue_timeout_seconds=1)
    registry.register(FleetCollector(router=router, admission=admission))
    MaintenanceMetrics(registry)
    registry.register(MaintenanceCollector(list, lambda name: False, lambda: 1.8e9))
    register_collectors(registry, replicas=list, router_load=dict,
                        settings=CollectorSettings(probe_bandwidth=False), model_dir=None, state_dir=tmp_path)
    catalogue = appliance_catalogue()
    live = exposed(registry)
    assert len(live) > 30
    for name, kind in live.items():
        assert catalogue.get(name) == kind, (name, kind, catalogue.get(name))


def test_vllm_catalogue_has_the_names_we_rely_on() -> None:
    catalogue = vllm_catalogue()
    assert catalogue["vllm:num_requests_running"] == "gauge"
    assert catalogue["vllm:num_preemptions"] == "counter"
    assert catalogue["vllm:time_to_first_token_seconds"] == "histogram"


def test_every_metric_referenced_exists() -> None:
    known = series_names(appliance_catalogue()) | series_names(vllm_catalogue())
    missing = {f"{where}: {name}" for where, expr in expressions() for name in metric_names(expr)
               if name not in known}
    assert not missing, sorted(missing)


def test_engine_queries_select_the_vllm_job_and_gateway_queries_the_appliance_job() -> None:
    for where, expr in expressions():
        for selector in re.findall(r"([a-zA-Z_:][\w:]*)\{([^}]*)\}", expr):
            name, matchers = selector
            job = "vllm" if name.startswith("vllm:") else "appliance"
            assert f'job="{job}"' in matchers, (where, name)


def test_committed_json_is_what_grafana_expects() -> None:
    for path in DIR.glob("*.json"):
        board = json.loads(path.read_text())
        assert "id" not in board
        for panel in content(board):
            assert [t["refId"] for t in panel["targets"]] == [chr(65 + i) for i in range(len(panel["targets"]))]


def test_docs_name_every_dashboard_and_panel() -> None:
    text = (REPO / "docs" / "dashboards.md").read_text()
    for uid, panel in panels():
        assert f"`{uid}`" in text, uid
        assert panel["title"] in text, f"{uid}: {panel['title']} is not in docs/dashboards.md"


# --- rows, runbook links, variables, thresholds ---------------------------------------------------------


def test_dashboards_are_divided_into_rows_and_the_docs_name_them() -> None:
    text = (REPO / "docs" / "dashboards.md").read_text()
    for uid, board in BOARDS.items():
        kinds = [panel["type"] for panel in board["panels"]]
        assert kinds[0] == "row" and kinds.count("row") >= 2, uid
        assert ("row", "row") not in set(zip(kinds, kinds[1:], strict=False)), f"{uid}: an empty row"
        assert kinds[-1] != "row", f"{uid}: an empty row at the end"
        for panel in board["panels"]:
            if panel["type"] == "row":
                assert panel["collapsed"] is False and panel["gridPos"]["w"] == 24 and panel["gridPos"]["x"] == 0
                assert f"*{panel['title']}*" in text, f"{uid}: row {panel['title']!r} is not in docs/dashboards.md"


def test_panels_under_a_row_sit_below_it() -> None:
    for uid, board in BOARDS.items():
        row_y = -1
        for panel in board["panels"]:
            if panel["type"] == "row":
                assert panel["gridPos"]["y"] > row_y, uid
                row_y = panel["gridPos"]["y"]
            else:
                assert panel["gridPos"]["y"] > row_y, (uid, panel["title"])


def test_panels_link_the_runbooks_of_their_alerts(alert_rules: list[dict]) -> None:
    config = load_config()
    names = {rule["alert"] for rule in alert_rules}
    linked: set[str] = set()
    for uid, panel in panels():
        for link in panel.get("links", []):
            name = link["title"].removeprefix("Runbook: ")
            assert name in names, f"{uid}: {panel['title']} links a runbook of no alert: {name}"
            assert link["url"] == config.runbook(name) and link["targetBlank"] is True
            assert (REPO / "docs" / "runbooks" / f"{name}.md").is_file()
            linked.add(name)
    # Watchdog is the pipeline's own heartbeat; ApplianceAbsent means Prometheus has no gateway series to draw.
    assert names - linked == {"Watchdog", "ApplianceAbsent"}


def test_runbook_links_follow_the_one_pattern_in_the_config(tmp_path: Path) -> None:
    raw = yaml.safe_load(CONFIG_PATH.read_text())
    raw["runbook_url"] = "https://wiki.example/oncall/{alertname}"
    boards = dashboards.build_dashboards(parse_config(raw))
    urls = {link["url"] for board in boards.values() for panel in content(board) for link in panel.get("links", [])}
    assert urls and all(url.startswith("https://wiki.example/oncall/Appliance") for url in urls)


def test_every_declared_variable_is_used() -> None:
    """Each variable is referenced by a query, an annotation or another variable (``replica`` follows ``model``)."""
    for uid, board in BOARDS.items():
        for variable in board["templating"]["list"]:
            name = variable["name"]
            rest = {**board, "templating": {"list": [v for v in board["templating"]["list"] if v is not variable]}}
            text = json.dumps(rest)
            assert re.search(rf"\$(\{{{name}\b|{name}\b)", text), f"{uid}: ${name} is declared but unused"


def _numbers(value: Any) -> Iterator[float]:
    if isinstance(value, dict):
        for item in value.values():
            yield from _numbers(item)
    elif isinstance(value, list):
        for item in value:
            yield from _numbers(item)
    elif isinstance(value, float):
        yield value


def test_no_float_noise_in_the_files() -> None:
    """0.0050000000000000044 is 1 - 0.995 computed in binary; the file says 0.005."""
    for path in DIR.glob("*.json"):
        for number in _numbers(json.loads(path.read_text())):
            assert float(f"{number:.12g}") == number, (path.name, number)
        assert not re.search(r"\d\.\d*0000000\d", path.read_text()), path.name


def test_alert_thresholds_and_selectors_come_from_the_config() -> None:
    raw = yaml.safe_load(CONFIG_PATH.read_text())
    raw["alerts"]["ApplianceKVCacheNearFull"]["threshold"] = 0.85
    raw["alerts"]["ApplianceQueueBacklog"]["threshold"] = 40
    raw["alerts"]["ApplianceSlowModelLoad"]["threshold_seconds"] = 600
    raw["selectors"] = {**raw["selectors"], "appliance": 'job="edge-gateway"', "vllm": 'job="engines"'}
    boards = dashboards.build_dashboards(parse_config(raw))

    def steps(uid: str, title: str) -> list[Any]:
        [panel] = [p for p in content(boards[uid]) if p["title"] == title]
        return [step["value"] for step in panel["fieldConfig"]["defaults"]["thresholds"]["steps"]]

    assert 0.85 in steps("appliance-capacity", "Max KV cache occupancy")
    assert 0.85 in steps("appliance-capacity", "KV cache occupancy by replica")
    assert 40 in steps("appliance-capacity", "Gateway queue")
    assert 600 in steps("appliance-maintenance", "Model load time")
    text = json.dumps(boards)
    assert 'job=\\"appliance\\"' not in text and 'job=\\"vllm\\"' not in text
    assert 'job=\\"edge-gateway\\"' in text and 'job=\\"engines\\"' in text


def test_the_generators_are_plain_functions_for_other_outputs() -> None:
    """What a Kubernetes ConfigMap generator would call: the dashboards as dicts, equal to the committed files."""
    boards = dashboards.build_dashboards(load_config())
    assert list(boards) == list(BOARDS)
    for uid, board in boards.items():
        assert json.loads((DIR / f"{uid}.json").read_text()) == json.loads(json.dumps(board))


# --- the capacity panels for prefix caching and the KV cache dtype -------------------------------------------------


def _panel(uid: str, title: str) -> dict[str, Any]:
    [panel] = [p for p in content(BOARDS[uid]) if p["title"] == title]
    return panel


def test_capacity_shows_the_prefix_cache_hit_rate() -> None:
    for title in ("Prefix cache hit rate", "Prefix cache hit ratio"):
        exprs = [t["expr"] for t in _panel("appliance-capacity", title)["targets"]]
        for expr in exprs:
            assert {"vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"} == metric_names(expr)
            assert "> 0)" in expr, "no sample, rather than NaN, while nothing was looked up"
    legends = [t["legendFormat"] for t in _panel("appliance-capacity", "Prefix cache hit ratio")["targets"]]
    assert legends == ["{{replica}}", "all replicas"]


def test_capacity_shows_routing_decisions_and_prefix_affinity() -> None:
    """Routing's own row: decisions by scorer, the router's prefix match beside the engines' cache hits, the
    index's memory, yields and the router's p99 time."""
    row = [p for p in BOARDS["appliance-capacity"]["panels"] if p["type"] == "row" and p["title"] == "Routing"]
    assert row, "no Routing row"
    decisions = _panel("appliance-capacity", "Routing decisions by scorer")["targets"]
    assert [t["legendFormat"] for t in decisions] == ["{{decided_by}}"]
    assert "by (decided_by)" in decisions[0]["expr"]
    match, hits = _panel("appliance-capacity", "Prefix match vs prefix cache hit")["targets"]
    assert match["expr"].startswith("histogram_quantile(0.5, ")
    assert metric_names(match["expr"]) == {"appliance_routing_prefix_match_ratio_bucket"}
    assert metric_names(hits["expr"]) == {"vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"}
    [p99] = _panel("appliance-capacity", "Routing time p99")["targets"]
    assert p99["expr"].startswith("histogram_quantile(0.99, ")
    assert _panel("appliance-capacity", "Prefix index memory")["fieldConfig"]["defaults"]["unit"] == "bytes"


def test_capacity_shows_the_kv_cache_dtype_per_replica() -> None:
    panel = _panel("appliance-capacity", "KV cache configuration")
    [query] = panel["targets"]
    assert panel["type"] == "table" and query["instant"] and query["format"] == "table"
    assert metric_names(query["expr"]) == {"vllm:cache_config_info"}
    grouping = re.match(r"max by \(([^)]*)\)", query["expr"]).group(1).split(", ")
    assert {"replica", "cache_dtype"} <= set(grouping)
    assert panel["transformations"][0]["options"]["excludeByName"]["Value"] is True


def test_the_kv_cache_labels_exist_in_vllm() -> None:
    """vllm:cache_config_info's labels are vLLM's CacheConfig fields (metrics_info() is its __dict__)."""
    from vllm.config import CacheConfig

    panel = _panel("appliance-capacity", "KV cache configuration")
    grouping = re.match(r"max by \(([^)]*)\)", panel["targets"][0]["expr"]).group(1).split(", ")
    fields = set(CacheConfig.__dataclass_fields__)
    assert set(grouping) - {"replica", "model"} <= fields, set(grouping) - fields


# --- the rules reference only metrics that exist, too ----------------------------------------------------------------


def test_every_metric_the_rules_reference_exists() -> None:
    groups = [group for name in ("recording.rules.yaml", "alerts.rules.yaml")
              for group in yaml.safe_load((REPO / "alerts" / name).read_text())["groups"]]
    recorded = {rule["record"] for group in groups for rule in group["rules"] if "record" in rule}
    known = series_names(appliance_catalogue()) | series_names(vllm_catalogue()) | recorded | {"up"}
    missing = {f"{rule.get('record') or rule.get('alert')}: {name}" for group in groups for rule in group["rules"]
               for name in metric_names(rule["expr"]) if name not in known}
    assert not missing, sorted(missing)
    assert {"vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"} <= {
        name for group in groups for rule in group["rules"] for name in metric_names(rule["expr"])}


def test_replica_counts_exclude_the_gateway_pods_views() -> None:
    """Issue 19: on Kubernetes gateway pods (role="gateway") export appliance_replica_state for the node pods'
    engines too; a panel that counts replicas over every series counts each engine 1 + G times. Counting panels
    select the engines' owners only (role all, or node), by the selector in alerts/config.yaml."""
    counting = [(uid, expr) for uid, expr in expressions()
                if re.search(r"\b(?:sum|count)\s*\(\s*appliance_replica_state\{", expr)]
    assert counting, "no panel counts replicas any more"
    for uid, expr in counting:
        assert 'role!="gateway"' in expr, (uid, expr)
