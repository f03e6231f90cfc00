"""GET /runbooks/{alertname}: the runbooks served by the appliance itself, so that an alert's
runbook_url works where GitHub cannot be reached; only the files in the runbooks folder, nothing else."""

from __future__ import annotations

import pytest

from appliance.paths import RUNBOOKS_DIR


def test_serves_every_runbook_as_markdown(client) -> None:
    books = sorted(RUNBOOKS_DIR.glob("*.md"))
    assert any(book.stem == "ApplianceNoReadyReplica" for book in books)
    for book in books:
        if book.stem == "README":
            continue
        response = client.get(f"/runbooks/{book.stem}")
        assert response.status_code == 200, book.name
        assert response.headers["content-type"].startswith("text/markdown")
        assert response.text == book.read_text()


def test_the_md_suffix_and_the_index_work_too(client) -> None:
    assert client.get("/runbooks/ApplianceDown.md").text == (RUNBOOKS_DIR / "ApplianceDown.md").read_text()
    index = client.get("/runbooks/")
    assert index.status_code == 200 and index.text == (RUNBOOKS_DIR / "README.md").read_text()


def test_no_key_needed_even_when_api_keys_are_set(make_client) -> None:
    client = make_client(api_keys=["secret"], admin_token="admin")
    assert client.get("/runbooks/ApplianceDown").status_code == 200


@pytest.mark.parametrize("name", [
    "NoSuchAlert", "..", "../README", "..%2F..%2Fpyproject.toml", "%2e%2e%2fpyproject", "..%2Fsettings.py",
    "ApplianceDown.md.bak", ".ApplianceDown", "ApplianceDown%00", "%2Fetc%2Fpasswd", "Appliance*",
])
def test_unknown_names_and_path_traversal_are_404(client, name: str) -> None:
    response = client.get(f"/runbooks/{name}")
    assert response.status_code == 404, (name, response.text[:200])
    assert "[project]" not in response.text and "root:" not in response.text


def test_other_paths_under_runbooks_are_404(client) -> None:
    for path in ("/runbooks/../../pyproject.toml", "/runbooks/sub/ApplianceDown", "/runbooks//etc/passwd"):
        response = client.get(path)
        assert response.status_code == 404, path
        assert "[project]" not in response.text


def test_the_runbooks_beside_the_assets_are_served(make_client, tmp_path) -> None:
    """Found by the compose test: in the image the package is installed in site-packages, and the runbooks lie
    with the alerts and dashboards under monitoring.assets_dir (/opt/appliance): every runbook was a 404."""
    books = tmp_path / "docs" / "runbooks"
    books.mkdir(parents=True)
    (books / "ApplianceDown.md").write_text("# ApplianceDown\n\nfrom the assets\n")
    client = make_client(monitoring={"assets_dir": str(tmp_path)})
    assert client.get("/runbooks/ApplianceDown").text == "# ApplianceDown\n\nfrom the assets\n"
    assert client.get("/runbooks/ApplianceNoReadyReplica").status_code == 404  # only that folder
