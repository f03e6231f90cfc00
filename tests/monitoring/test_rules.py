"""The generated Prometheus rules: current, valid, unit-tested by promtool, and each alert fully documented."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from appliance.gateway.observation.metrics import LATENCY_BUCKETS, buckets_with
from appliance.monitoring import rules
from appliance.monitoring.config import load_config, parse_config
from appliance.settings import Settings

from .conftest import ALERTS, REPO

RUNBOOKS = REPO / "docs" / "runbooks"
RULE_FILES = [ALERTS / rules.RECORDING_FILE, ALERTS / rules.ALERTING_FILE]
TEST_FILES = sorted((ALERTS / "tests").glob("*.yaml"))
SECTIONS = ("Meaning", "Impact", "Diagnosis", "Mitigation")


@pytest.fixture(scope="module")
def config() -> dict:
    return load_config().model_dump(by_alias=True)


def alert_names(alert_rules: list[dict]) -> set[str]:
    return {rule["alert"] for rule in alert_rules}


def promtool_cases() -> tuple[dict[str, int], dict[str, int], set[str]]:
    """Per alert: firing cases, not-firing cases; and alerts whose annotations some case asserts."""
    firing: dict[str, int] = {}
    quiet: dict[str, int] = {}
    annotated: set[str] = set()
    for path in TEST_FILES:
        for test in yaml.safe_load(path.read_text())["tests"]:
            for case in test.get("alert_rule_test", []):
                name = case["alertname"]
                expected = case.get("exp_alerts") or []
                counts = firing if expected else quiet
                counts[name] = counts.get(name, 0) + 1
                if any(alert.get("exp_annotations") for alert in expected):
                    annotated.add(name)
    return firing, quiet, annotated


def test_committed_rule_files_match_their_source(config: dict) -> None:
    diff = rules.stale(rules.render(config), ALERTS)
    assert not diff, "stale rule files: run python -m appliance.monitoring.rules --write\n" + diff


def test_generated_files_say_so() -> None:
    for path in RULE_FILES:
        assert path.read_text().startswith(rules.HEADER)


def test_check_mode_fails_on_stale_files_and_passes_on_fresh(tmp_path: Path, capsys) -> None:
    assert rules.main(["--check", "--out", str(tmp_path)]) == 1
    assert "+++ rendered/alerts.rules.yaml" in capsys.readouterr().out
    assert rules.main(["--write", "--out", str(tmp_path)]) == 0
    assert rules.main(["--check", "--out", str(tmp_path)]) == 0


def test_ttft_threshold_is_a_histogram_bucket(config: dict) -> None:
    """Burn-rate rules read the le="<threshold>" bucket: it must exist, or the SLI is silently empty."""
    threshold = config["slos"]["ttft"]["threshold_seconds"]
    assert threshold in buckets_with(LATENCY_BUCKETS, [Settings().gateway.slo_ttft_p95_seconds])
    assert f'le="{threshold}"' in (ALERTS / rules.RECORDING_FILE).read_text()


def test_config_that_would_miss_a_bucket_is_refused(config: dict) -> None:
    broken = {**config, "slos": {**config["slos"], "ttft": {**config["slos"]["ttft"], "threshold_seconds": 0.75}}}
    with pytest.raises(ValueError, match="bucket"):
        rules.validate_config(broken)


def test_recording_rules_follow_level_metric_operations() -> None:
    groups = yaml.safe_load((ALERTS / rules.RECORDING_FILE).read_text())["groups"]
    records = [rule["record"] for group in groups for rule in group["rules"]]
    assert records and all(re.fullmatch(r"[a-z_]+:[a-z0-9_]+:[a-z0-9_]+", name) for name in records), records
    for window in ("5m", "30m", "1h", "2h", "6h", "1d", "3d"):
        assert f"job:appliance_requests_errors:ratio_rate{window}" in records
        assert f"job:appliance_request_ttft_slow:ratio_rate{window}" in records


def test_promtool_check_rules(promtool: str) -> None:
    result = subprocess.run([promtool, "check", "rules", *map(str, RULE_FILES)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_test_rules(promtool: str) -> None:
    result = subprocess.run([promtool, "test", "rules", *map(str, TEST_FILES)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_is_labelled_and_annotated(alert_rules: list[dict], config: dict) -> None:
    for rule in alert_rules:
        name = rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning", "none"}, name
        annotations = rule["annotations"]
        assert annotations.get("summary") and annotations.get("description"), name
        assert annotations["runbook_url"] == parse_config(config).runbook(name), name  # the one pattern


def test_contract_alert_names(alert_rules: list[dict]) -> None:
    """Issue 5's webhook whitelist acts on these names; they must carry a replica and stay uninhibited."""
    by_name = {rule["alert"]: rule for rule in alert_rules}
    for name in ("ApplianceFragmentationRising", "ApplianceReplicaHung"):
        assert by_name[name]["labels"]["remediation"] == "auto"
        assert "replica" in by_name[name]["expr"]
    assert by_name["ApplianceFragmentationRising"]["labels"]["severity"] == "warning"


def test_every_alert_has_a_runbook_and_every_runbook_an_alert(alert_rules: list[dict]) -> None:
    names = alert_names(alert_rules)
    books = {path.stem for path in RUNBOOKS.glob("*.md")} - {"README"}
    assert names - books == set(), "alerts without a runbook"
    assert books - names == set(), "runbooks without an alert"
    for name in names:
        text = (RUNBOOKS / f"{name}.md").read_text()
        headings = re.findall(r"^## (\w+)", text, re.M)
        for section in SECTIONS:
            assert section in headings, f"{name}.md lacks a '## {section}' section"


def test_runbook_index_lists_every_alert(alert_rules: list[dict]) -> None:
    index = (RUNBOOKS / "README.md").read_text()
    for name in alert_names(alert_rules):
        assert f"[{name}]({name}.md)" in index, name


def test_every_alert_has_promtool_cases(alert_rules: list[dict]) -> None:
    firing, quiet, annotated = promtool_cases()
    for name in alert_names(alert_rules):
        assert firing.get(name), f"no promtool case where {name} fires"
        assert name in annotated, f"no promtool case asserts the annotations of {name}"
        if name != "Watchdog":  # the dead man's switch is never quiet
            assert quiet.get(name), f"no promtool case where {name} stays quiet"


def test_prefix_cache_recording_rules_are_unit_tested() -> None:
    """The hit-ratio records (per replica and per model) have promtool cases with expected values."""
    tested = {case["expr"] for path in TEST_FILES for test in yaml.safe_load(path.read_text())["tests"]
              for case in test.get("promql_expr_test", [])}
    assert {"model_replica:vllm_prefix_cache_hit:ratio_rate5m", "model:vllm_prefix_cache_hit:ratio_rate5m"} <= tested


def test_rule_groups_are_plain_data_equal_to_the_files(config: dict) -> None:
    """What a Kubernetes PrometheusRule generator would call: every group, equal to the committed files."""
    committed = [group for path in RULE_FILES for group in yaml.safe_load(path.read_text())["groups"]]
    assert rules.rule_groups(config) == committed
