"""The benchmarks in bench/ are run by hand, not in CI: this keeps each one importable, so that a refactor of the
package they drive (a moved function, a renamed module) breaks here and not on the day someone needs the numbers."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(script: Path, monkeypatch) -> ModuleType:
    """Import a bench script as a module, undoing what it changes in ``sys`` when the test ends."""
    name = f"bench_{script.stem}"
    spec = importlib.util.spec_from_file_location(name, script)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses look their module up while the class is built
    monkeypatch.setattr(sys, "path", list(sys.path))  # the scripts put the repository first on the path
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", sorted(BENCH.glob("*.py")), ids=lambda p: p.name)
def test_benchmark_imports(script: Path, monkeypatch):
    module = load_bench(script, monkeypatch)
    assert callable(getattr(module, "main", None)), f"{script.name} has no main()"


def test_the_soak_judges_the_gateways_memory_beyond_its_prefix_index(monkeypatch):
    """The prefix index fills by design (bounded by its budget): RSS that grows by what the index grew passes; RSS
    that grows 10% beyond it fails. The raw growth is reported either way."""
    soak = load_bench(BENCH / "soak.py", monkeypatch)
    drift = {"verdict": "stable", "first": 0.1, "last": 0.1, "first_last_change": 0.0, "trend_change": 0.0}
    run = {"verdict": "stable", "drift": {"ttft_p95_s": drift}, "summary": {"requests": 10, "succeeded": 10}}

    def rows(rss_end: float, index_end: float) -> list[dict]:
        keys = frozenset({"a"})
        return [{"t_s": 0, "rss_bytes": 100e6, "prefix_index_bytes": 0.0, "series": 1, "_keys": keys},
                {"t_s": 60, "rss_bytes": rss_end, "prefix_index_bytes": index_end, "series": 1, "_keys": keys}]

    filled = soak.summarize(rows(rss_end=120e6, index_end=20e6), warmup_s=0, soak=run)
    assert filled["rss_growth"] == pytest.approx(0.20) and filled["rss_growth_beyond_prefix_index"] == 0
    assert filled["pass"]["rss_growth_beyond_prefix_index_below_5pct"]
    leaking = soak.summarize(rows(rss_end=130e6, index_end=20e6), warmup_s=0, soak=run)
    assert leaking["rss_growth_beyond_prefix_index"] == pytest.approx(0.10)
    assert not leaking["pass"]["rss_growth_beyond_prefix_index_below_5pct"]


def test_the_relay_hooks_bench_drives_the_request_path_as_the_gateway_builds_it(monkeypatch):
    """It reaches into the transport (``admit``, the response headers): a change there breaks it here. Its streams
    end as the gateway's do, every slot given back."""
    relay_hooks = load_bench(BENCH / "relay_hooks.py", monkeypatch)
    per_request, per_read = relay_hooks.measure(tokens=4, requests=3)
    assert per_request > 0 and per_read > 0
