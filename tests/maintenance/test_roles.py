"""One credential per role: the admin token opens everything the narrower ones do; the alerts token
opens Alertmanager's webhook and nothing else; the metrics token opens /metrics and /sd/targets and nothing else.
Checked as a matrix over every route kind and every credential, on the gateway's real app (stub engines)."""

from __future__ import annotations

import pytest

from tests.maintenance.support import payload

TOKENS = {"admin": "adm-t0ken", "alerts": "alr-t0ken", "metrics": "met-t0ken", "key": "api-k3y"}
ROLE_SETTINGS = {"admin_token": TOKENS["admin"], "alerts_token": TOKENS["alerts"],
                 "metrics_token": TOKENS["metrics"], "api_keys": [TOKENS["key"]]}
# route -> the credentials it accepts
ACCEPTS = {
    ("GET", "/admin/status"): {"admin"},
    ("POST", "/admin/alerts"): {"admin", "alerts"},
    ("GET", "/metrics"): {"admin", "metrics"},
    ("GET", "/sd/targets"): {"admin", "metrics"},
    ("GET", "/v1/models"): {"key"},
}
OPEN = [("GET", "/health/live")]


def call(client, method: str, path: str, token: str | None):
    headers = {"authorization": f"Bearer {token}"} if token else {}
    if method == "POST":
        return client.post(path, json=payload(_resolved()), headers=headers)
    return client.get(path, headers=headers)


def _resolved() -> dict:
    return {"status": "resolved", "labels": {"alertname": "Nothing", "severity": "info"}, "annotations": {},
            "startsAt": "2026-12-02T03:00:00Z", "endsAt": "", "generatorURL": "", "fingerprint": "f"}


def test_each_credential_opens_exactly_its_routes(make_app):
    client, _replicas, _registry = make_app(**ROLE_SETTINGS)
    for (method, path), accepted in ACCEPTS.items():
        for role, token in [*TOKENS.items(), ("none", None), ("wrong", "wr0ng")]:
            status = call(client, method, path, token).status_code
            if role in accepted:
                assert status == 200, (method, path, role, status)
            else:
                assert status == 401, (method, path, role, status)
                error = call(client, method, path, token).json()["error"]
                assert error["type"] and error["code"], error
    for method, path in OPEN:
        assert call(client, method, path, None).status_code == 200


def test_the_alerts_token_alone_enables_the_webhook_but_not_the_admin_api(make_app):
    client, _replicas, _registry = make_app(admin_token=None, alerts_token=TOKENS["alerts"])
    assert call(client, "POST", "/admin/alerts", TOKENS["alerts"]).status_code == 200
    assert call(client, "GET", "/admin/status", TOKENS["alerts"]).status_code == 403  # admin API off
    disabled, _, _ = make_app(admin_token=None)
    assert call(disabled, "POST", "/admin/alerts", TOKENS["alerts"]).status_code == 403


@pytest.mark.parametrize("api_keys", [[], [TOKENS["key"]]], ids=["open", "keys"])
def test_without_a_metrics_token_metrics_need_the_admin_token_once_keys_are_set(make_app, api_keys):
    """/metrics names the tenants and their usage: open only on an appliance that is open anyway."""
    client, _replicas, _registry = make_app(admin_token=TOKENS["admin"], api_keys=api_keys)
    assert call(client, "GET", "/metrics", None).status_code == (401 if api_keys else 200)
    assert call(client, "GET", "/metrics", TOKENS["admin"]).status_code == 200
    if api_keys:
        assert call(client, "GET", "/metrics", TOKENS["key"]).status_code == 401  # a client's key: no
    assert call(client, "GET", "/sd/targets", TOKENS["admin"]).status_code == 200
    assert call(client, "GET", "/sd/targets", None).status_code == (401 if api_keys else 200)
    if api_keys:
        assert call(client, "GET", "/sd/targets", TOKENS["key"]).status_code == 200


def test_the_metrics_token_closes_sd_targets_even_without_api_keys(make_app):
    client, _replicas, _registry = make_app(admin_token=TOKENS["admin"], metrics_token=TOKENS["metrics"])
    for path in ("/metrics", "/sd/targets"):
        assert call(client, "GET", path, None).status_code == 401
        assert call(client, "GET", path, TOKENS["metrics"]).status_code == 200
