"""The background image build of scripts/test: where podman cannot run it builds nothing, says why, and exits 0
(the compose test itself then skips, or fails under APPLIANCE_REQUIRE_TOOLS=1)."""

from __future__ import annotations

import pytest

from tests.compose import prebuild


def test_where_podman_cannot_run_nothing_is_built_and_the_reason_is_said(monkeypatch, capsys) -> None:
    monkeypatch.setattr(prebuild, "cannot_run_reason", lambda: "podman not found: apt-get install podman")
    monkeypatch.setattr(prebuild, "build_images", lambda *_: pytest.fail("built without podman"))
    assert prebuild.main() == 0
    assert "nothing built: podman not found" in capsys.readouterr().out
