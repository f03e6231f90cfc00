"""The benchmarks in bench/ are run by hand, not in CI: this keeps each one importable, so that a refactor of the
package they drive (a moved function, a renamed module) breaks here and not on the day someone needs the numbers."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.mark.parametrize("script", sorted(BENCH.glob("*.py")), ids=lambda p: p.name)
def test_benchmark_imports(script: Path, monkeypatch):
    name = f"bench_{script.stem}"
    spec = importlib.util.spec_from_file_location(name, script)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses look their module up while the class is built
    monkeypatch.setattr(sys, "path", list(sys.path))  # the scripts put the repository first on the path
    spec.loader.exec_module(module)
    assert callable(getattr(module, "main", None)), f"{script.name} has no main()"
