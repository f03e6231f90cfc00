"""``appliance status | drain | restart | requests``: the admin API from a shell, for runbooks.

Standard library only: these commands must work from a bare shell on the host during an incident.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import quote, urlencode

DEFAULT_URL = "http://127.0.0.1:8000"
TOKEN_ENV = "APPLIANCE_ADMIN_TOKEN"
TOKEN_FILE_ENV = "APPLIANCE_ADMIN_TOKEN_FILE"
METRICS_TOKEN_ENV = "APPLIANCE_METRICS_TOKEN"
METRICS_TOKEN_FILE_ENV = "APPLIANCE_METRICS_TOKEN_FILE"
# Where `appliance up` keeps the token it generated when none was configured (see ensure_admin_token).
TOKEN_FILE = "admin-token"


class AdminError(RuntimeError):
    """The admin call failed; the message is what the operator needs to see."""


def admin_token() -> str | None:
    """$APPLIANCE_ADMIN_TOKEN, else the file $APPLIANCE_ADMIN_TOKEN_FILE names (compose and Kubernetes mount the
    token as a file: the same setting the appliance read it from), else the token `appliance up` generated: under
    $APPLIANCE_STATE_DIR, ./var, or the source tree's var/ (where `make up` runs), so the operator commands work
    from any directory."""
    if token := token_from_env(TOKEN_ENV, TOKEN_FILE_ENV):
        return token
    for state_dir in token_dirs():
        try:
            with open(os.path.join(state_dir, TOKEN_FILE)) as f:
                if token := f.read().strip():
                    return token
        except OSError:
            continue
    return None


def token_from_env(name: str, file_name: str) -> str | None:
    """$name, else the first line of the file $file_name names that is neither blank nor a ``#`` comment (the
    format of the appliance's *_file secret settings); None when neither gives one. ``name`` is the setting's
    earlier variable (APPLIANCE_ADMIN_TOKEN); its sectioned one (APPLIANCE_GATEWAY__ADMIN_TOKEN) is read first, as
    the appliance reads it (appliance.settings.FLAT_ALIASES)."""
    if token := (os.environ.get(sectioned(name), "") or os.environ.get(name, "")).strip():
        return token
    if path := os.environ.get(sectioned(file_name)) or os.environ.get(file_name):
        try:
            with open(path) as f:
                return next((line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")),
                            None)
        except OSError:
            return None
    return None


def sectioned(name: str) -> str:
    """APPLIANCE_ADMIN_TOKEN -> APPLIANCE_GATEWAY__ADMIN_TOKEN: the tokens are keys of the gateway section."""
    return name.replace("APPLIANCE_", "APPLIANCE_GATEWAY__", 1)


def metrics_token() -> str | None:
    """The read-only credential for the appliance's /metrics (its ``metrics_token`` setting, from
    $APPLIANCE_METRICS_TOKEN or the file $APPLIANCE_METRICS_TOKEN_FILE names), else the admin token, which
    /metrics accepts too; None where neither is found (an appliance without a metrics token serves /metrics openly)."""
    return token_from_env(METRICS_TOKEN_ENV, METRICS_TOKEN_FILE_ENV) or admin_token()


def token_dirs() -> list[str]:
    from appliance.paths import DEFAULT_STATE_DIR

    configured = os.environ.get("APPLIANCE_STATE_DIR")
    return [configured] if configured else ["var", str(DEFAULT_STATE_DIR)]


def no_token_message() -> str:
    return (f"no admin token: set {TOKEN_ENV} (or {TOKEN_FILE_ENV}), or run from where `appliance up` wrote "
            f"{TOKEN_FILE} (looked in {', '.join(token_dirs())})")


def call(url: str, method: str, path: str, *, timeout: float = 30) -> dict[str, Any]:
    token = admin_token()
    if not token:
        raise AdminError(no_token_message())
    request = urllib.request.Request(f"{url.rstrip('/')}{path}", method=method, data=b"" if method == "POST" else None,
                                     headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body: dict[str, Any] = json.loads(response.read() or b"{}")
            return body
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        raise AdminError(f"{method} {path}: HTTP {exc.code}: {message}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise AdminError(f"cannot reach the appliance at {url}: {exc}") from exc
    except ValueError as exc:  # urllib's "unknown url type" and the like: a URL it cannot even try
        raise AdminError(f"{url!r} is not a URL urllib can call: {exc}") from exc


def format_status(status: dict[str, Any]) -> str:
    lines = [f"model {status['model']}  kv-cache {status.get('kv_cache_dtype', 'auto')}  "
             f"ready {status['ready_replicas']}/{len(status['replicas'])}  "
             f"in-flight {status['in_flight']}  queued {status['queue_length']}"
             + ("  DRAINING" if status["draining"] else "")]
    header = f"{'replica':<12} {'state':<10} {'where':<10} {'out':>4} {'limit':>5} {'kv':>5} {'wait':>5} " \
             f"{'restarts':>8} {'load_s':>7}"
    lines.append(header)
    for r in status["replicas"]:
        kv = "-" if r["kv_cache_usage"] is None else f"{r['kv_cache_usage']:.0%}"
        waiting = "-" if r["engine_waiting"] is None else f"{r['engine_waiting']:.0f}"
        load = "-" if r["model_load_seconds"] is None else f"{r['model_load_seconds']:.1f}"
        state = r["state"] + ("*" if r["ejected"] else "")
        lines.append(f"{r['name']:<12} {state:<10} {r['placement'] or '-':<10} {r['outstanding']:>4} "
                     f"{r['concurrency_limit']:>5} {kv:>5} {waiting:>5} {r['restarts'] or 0:>8} {load:>7}")
    if any(r["ejected"] for r in status["replicas"]):
        lines.append("* ejected from routing: " + "; ".join(
            f"{r['name']}: {r['ejection_reason']}" for r in status["replicas"] if r["ejected"]))
    lines += format_replica_errors(status["replicas"])
    lines += format_scheduling(status["replicas"])
    lines += format_tenants(status.get("tenants") or [])
    lines += format_quota_store(status.get("quota_store") or {})
    if status.get("maintenance"):
        lines += format_maintenance(status["maintenance"])
    return "\n".join(lines)


def format_scheduling(replicas: list[dict[str, Any]]) -> list[str]:
    """Where the tenants' priority reaches the engine's own queue: said once any engine schedules by priority (the
    others, fcfs or not run by the appliance, get none: the gateway's fair share alone orders their requests)."""
    policies = {r["name"]: r.get("scheduling_policy") or "unknown" for r in replicas}
    if "priority" not in policies.values():
        return []
    return ["engine scheduling: " + "; ".join(f"{name} {policy}" for name, policy in policies.items())]


def format_quota_store(store: dict[str, Any]) -> list[str]:
    """The shared quota store's state; nothing for the embedded buckets (one gateway: nothing to say)."""
    if store.get("kind") != "redis":
        return []
    if store.get("reachable"):
        return ["quota store: redis, reachable"]
    since = store.get("down_since")
    when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since)) if since else ""
    return [f"! quota store: redis UNREACHABLE{when}: requests fail {store.get('failure')} "
            "(docs/runbooks/ApplianceQuotaStoreUnreachable.md)"]


TOP_TENANTS = 10


def format_tenants(tenants: list[dict[str, Any]], top: int = TOP_TENANTS) -> list[str]:
    """The heaviest tenants (the gateway sends them heaviest first): totals since start and what each holds now.
    Nothing when the only tenant is the default one (no tenants configured): the fleet line says it all."""
    if not tenants or [t["tenant"] for t in tenants] == ["default"]:
        return []
    lines = [f"{'tenant':<20} {'in-flight':>9} {'queued':>6} {'requests':>9} {'prompt_tok':>11} "
             f"{'compl_tok':>11} {'cached':>9} {'429s':>6}"]
    for t in tenants[:top]:
        lines.append(f"{t['tenant']:<20} {t['in_flight']:>9} {t['queued']:>6} {t['requests']:>9} "
                     f"{t['prompt_tokens']:>11} {t['completion_tokens']:>11} {t['cached_prompt_tokens']:>9} "
                     f"{t['rate_limited']:>6}")
    if len(tenants) > top:
        lines.append(f"... and {len(tenants) - top} more (GET /admin/status for all)")
    return lines


def format_replica_errors(replicas: list[dict[str, Any]]) -> list[str]:
    """Replicas whose engine could not be started, or that said why they are not serving: the first thing an
    operator needs when a replica stays out of routing (a spawn failure never reaches the engine's log)."""
    lines = []
    for r in replicas:
        failures = r.get("spawn_failures") or 0
        if failures:
            lines.append(f"! {r['name']}: {failures} failed spawn(s); last error: {r.get('last_error') or '-'}")
        elif r.get("last_error") and r["state"] != "ready":
            lines.append(f"! {r['name']}: {r['last_error']}")
    return lines


def format_maintenance(m: dict[str, Any]) -> list[str]:
    """Next window, last restart, what maintenance is doing: the lines a runbook asks the operator to check."""
    def when(unix: float | None) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(unix)) if unix else "never"

    window = f"next window {m['next_window']}" if m.get("enabled") else "scheduled maintenance off"
    lines = [f"maintenance: {window}; last restart {when(m.get('last_restart'))}"]
    if m.get("rolling_restart_in_progress"):
        lines.append(f"  rolling restart in progress (now: {m.get('rolling_restart_current') or '-'})")
    if m.get("restarting"):
        lines.append(f"  restarting: {', '.join(m['restarting'])}")
    if m.get("restart_wanted"):
        lines.append(f"  restart wanted, waiting for low traffic: {m['restart_wanted']}")
    if m.get("hung_replicas"):
        lines.append(f"  HUNG (running requests, no tokens): {', '.join(m['hung_replicas'])}")
    last = m.get("last_action")
    if last:
        target = f" {last['replica']}" if last.get("replica") else ""
        lines.append(f"  last action: {last['action']}{target} ({last['trigger']}) {last['result']} "
                     f"at {when(last['at'])}")
    return lines


# --- the request records (GET /admin/requests): `appliance requests` ------------------------------------------


def requests_path(limit: int = 50, tenant: str | None = None, replica: str | None = None,
                  min_seconds: float | None = None, status: str | None = None) -> str:
    """GET /admin/requests with the filters given (those left None are not sent)."""
    query = {"limit": limit, "tenant": tenant, "replica": replica, "min_seconds": min_seconds, "status": status}
    return "/admin/requests?" + urlencode({k: v for k, v in query.items() if v is not None})


def request_path(request_id: str) -> str:
    """GET /admin/requests/{id}, the id quoted whole: a client's x-request-id may hold any character."""
    return "/admin/requests/" + quote(request_id, safe="")


def format_requests(body: dict[str, Any], now: float | None = None) -> str:
    """The records as a table, newest first: one line per request, what an operator scans for the slow one."""
    if not body.get("capacity"):
        return "request records are off (gateway.request_records is 0)"
    records = body.get("requests") or []
    if not records:
        return f"no request matches (the gateway holds the last {body.get('held', 0)} of at most {body['capacity']})"
    now = time.time() if now is None else now
    width = max(len("id"), *(len(r["id"]) for r in records))
    lines = [f"{'id':<{width}} {'age':>5} {'tenant':<12} {'route':<17} {'replica':<12} {'decided_by':<14} "
             f"{'wait':>7} {'ttft':>7} {'e2e':>7} {'status':<12} {'retry/mig':>9}"]
    for r in records:
        status = f"{r['status'] or '-'} {r['outcome'] or ''}".strip()
        moves = f"{r['retries']}/{len(r['migrations'])}"
        lines.append(f"{r['id']:<{width}} {age(now - r['arrived_at']):>5} {r['tenant'] or '-':<12} "
                     f"{_route(r['route']):<17} {r['replica'] or '-':<12} {r['decided_by'] or '-':<14} "
                     f"{_secs(r['queue_wait_seconds']):>7} {_secs(r['ttft_seconds']):>7} "
                     f"{_secs(r['e2e_seconds']):>7} {status:<12} {moves:>9}")
    lines.append(f"{len(records)} shown; the gateway holds the last {body['held']} of at most {body['capacity']} "
                 "(appliance requests --id ID for one request's routing decision)")
    return "\n".join(lines)


def format_request(record: dict[str, Any], now: float | None = None) -> str:
    """One request in full: its timings and end, then each attempt with its routing decision explained (every
    replica considered, the filter that removed each one left out, each scorer's value), then its migrations."""
    now = time.time() if now is None else now
    lines = [f"request {record['id']}  {record['route']}  tenant {record['tenant'] or '-'}"
             f"{'  stream' if record['stream'] else ''}  {age(now - record['arrived_at'])} ago",
             f"status {record['status'] or '-'} {record['outcome'] or ''}  queue wait "
             f"{_secs(record['queue_wait_seconds'])}  ttft {_secs(record['ttft_seconds'])}  "
             f"e2e {_secs(record['e2e_seconds'])}"]
    for number, attempt in enumerate(record["attempts"], start=1):
        lines += _format_attempt(number, attempt)
    for number, move in enumerate(record["migrations"], start=1):
        lines.append(f"migration {number}: {move['from_replica']} -> {move['to_replica'] or '-'} ({move['reason']}, "
                     f"{move['sent_tokens']} tokens already sent): {move['outcome']}")
    return "\n".join(lines)


def _format_attempt(number: int, attempt: dict[str, Any]) -> list[str]:
    ended = attempt["outcome"] or "running"
    lines = [f"attempt {number}: {attempt['replica']} at +{_secs(attempt['started_after_seconds'])} (queue wait "
             f"{_secs(attempt['queue_wait_seconds'])}): {ended}" + (f" ({attempt['reason']})"
                                                                     if attempt["reason"] else "")]
    decision = attempt.get("decision")
    if decision:
        lines.append(f"  picked {decision['picked']}, decided by {decision['decided_by']}"
                     + (f", total {decision['total']:.3f}" if decision["totals"] else ""))
        lines += ["  " + line for line in _decision_table(decision)]
    return lines


def _decision_table(decision: dict[str, Any]) -> list[str]:
    """Every replica considered: the filter that removed it, or its unweighted scores (? = unknown, counted as
    neutral) and weighted total."""
    scorers = list(dict.fromkeys(name for scores in decision["scores"].values() for name in scores))
    width = max(len("replica"), *(len(name) + 1 for name in decision["candidates"]))  # + 1: the pick's "*"
    lines = [f"{'replica':<{width}} {'removed by':<12}" + "".join(f" {s:>11}" for s in scorers)
             + (f" {'total':>7}" if decision["totals"] else "")]
    for name in decision["candidates"]:
        scores = decision["scores"].get(name, {})
        total = decision["totals"].get(name)
        mark = "*" if name == decision["picked"] else ""
        line = (f"{name + mark:<{width}} {decision['removed'].get(name, '-'):<12}"
                + "".join(f" {_score(scores.get(s), name in decision['scores']):>11}" for s in scorers)
                + (f" {'' if total is None else f'{total:.3f}':>7}" if decision["totals"] else ""))
        lines.append(line.rstrip())
    return lines


def _score(value: float | None, scored: bool) -> str:
    if not scored:
        return ""
    return "?" if value is None else f"{value:.3f}"


def _secs(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f}ms" if value < 1 else f"{value:.2f}s"


def age(seconds: float) -> str:
    """How long ago, in its largest unit: 40s, 5m, 3h, 2d."""
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def _route(route: str) -> str:
    return route.removeprefix("/v1/")
