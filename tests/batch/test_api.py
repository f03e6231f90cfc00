"""OpenAI's Files and Batches APIs on the gateway (fake engines: what is verified is the gateway's own logic): the
whole flow, each tenant alone with its own files, batches and tokens, and every bad input answered with OpenAI's
error JSON and the right 4xx, never a 500."""

from __future__ import annotations

import json

import pytest

from appliance.context import context_of
from tests.batch.conftest import (
    ADMIN,
    auth,
    chat_line,
    create,
    jsonl,
    result_lines,
    run_batch,
    upload,
    wait_for,
)
from tests.gateway.live import wait_until


def openai_error(response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code, error
    return error


def test_a_batch_runs_every_line_and_its_files_hold_each_answer_once(client, stubs):
    uploaded = upload(client, jsonl([chat_line(f"req-{i}", f"question {i}") for i in range(12)]))
    assert uploaded.status_code == 200
    file = uploaded.json()
    assert (file["object"], file["purpose"], file["filename"], file["status"]) == ("file", "batch", "input.jsonl",
                                                                                    "processed")
    created = create(client, file["id"], metadata={"job": "nightly"})
    assert created.status_code == 200
    assert created.json()["status"] == "validating" and created.json()["metadata"] == {"job": "nightly"}
    batch = wait_for(client, created.json()["id"])
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": 12, "completed": 12, "failed": 0}
    assert batch["error_file_id"] is None
    for stamp in ("in_progress_at", "finalizing_at", "completed_at"):
        assert batch[stamp] >= batch["created_at"]
    assert batch["expires_at"] == batch["created_at"] + 24 * 3600
    outputs = result_lines(client, batch["output_file_id"])
    assert [line["custom_id"] for line in outputs] == [f"req-{i}" for i in range(12)]  # input order
    assert all(line["response"]["status_code"] == 200 and line["error"] is None for line in outputs)
    assert {line["response"]["body"]["choices"][0]["message"]["content"] for line in outputs} == {"hello"}
    assert batch["usage"]["output_tokens"] == 12 * 3
    assert sum(len(stub.received) for stub in stubs) == 12
    sent = [r.body for stub in stubs for r in stub.received]
    assert all(body.get("stream") is not True and body["model"] == "demo" for body in sent)
    output_file = client.get(f"/v1/files/{batch['output_file_id']}", headers=auth("team-a")).json()
    assert output_file["purpose"] == "batch_output"
    listed = client.get("/v1/files", headers=auth("team-a")).json()
    assert [f["id"] for f in listed["data"]] == [batch["output_file_id"], file["id"]]  # newest first
    assert client.get("/v1/batches", headers=auth("team-a")).json()["data"][0]["id"] == batch["id"]


def test_a_line_is_recorded_as_a_request_of_its_tenant(client):
    batch = run_batch(client, [chat_line("only")])
    request_id = result_lines(client, batch["output_file_id"])[0]["id"]
    record = client.get(f"/admin/requests/{request_id}", headers={"authorization": f"Bearer {ADMIN}"}).json()
    assert (record["tenant"], record["status"], record["route"]) == ("team-a", 200, "chat")


def test_malformed_lines_fail_alone(client):
    batch = run_batch(client, [chat_line("good-1"), "{not json", chat_line("bad", messages=[]),
                               chat_line("good-2")])
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 4, "completed": 2, "failed": 2}
    assert [line["custom_id"] for line in result_lines(client, batch["output_file_id"])] == ["good-1", "good-2"]
    errors = result_lines(client, batch["error_file_id"])
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [(None, "invalid_json"),
                                                                      ("bad", "invalid_request")]


def test_an_engine_refusal_goes_to_the_error_file(client, stubs):
    for stub in stubs:
        stub.fail_status = 400
    batch = run_batch(client, [chat_line("a")])
    assert batch["request_counts"] == {"total": 1, "completed": 0, "failed": 1}
    (error,) = result_lines(client, batch["error_file_id"])
    assert error["response"]["status_code"] == 400 and error["error"] is None


def test_a_server_error_is_tried_again_then_reported(make_batch_client, stubs):
    client = make_batch_client(batch={"max_attempts": 2})
    for stub in stubs:
        stub.fail_status = 500
    batch = run_batch(client, [chat_line("a")])
    (error,) = result_lines(client, batch["error_file_id"])
    assert error["response"]["status_code"] >= 500  # the engine's 500, or the gateway's 502 after its own retry
    retried = context_of(client.app).registry.get_sample_value("appliance_batch_lines_deferred_total",
                                                               {"reason": "server_error"})
    assert retried == 1  # two tries: one retry, then the error went to the error file


def test_each_tenant_sees_only_its_own(client):
    file_a = upload(client, jsonl([chat_line("a")]), "team-a").json()
    batch_a = wait_for(client, create(client, file_a["id"], "team-a").json()["id"], "team-a")
    output = batch_a["output_file_id"]
    for path in (f"/v1/files/{file_a['id']}", f"/v1/files/{file_a['id']}/content", f"/v1/files/{output}/content"):
        openai_error(client.get(path, headers=auth("team-b")), 404, "file_not_found")
    openai_error(client.delete(f"/v1/files/{file_a['id']}", headers=auth("team-b")), 404, "file_not_found")
    openai_error(client.get(f"/v1/batches/{batch_a['id']}", headers=auth("team-b")), 404, "batch_not_found")
    openai_error(client.post(f"/v1/batches/{batch_a['id']}/cancel", headers=auth("team-b")), 404,
                 "batch_not_found")
    openai_error(create(client, file_a["id"], "team-b"), 404, "file_not_found")  # not another tenant's input
    assert client.get("/v1/files", headers=auth("team-b")).json()["data"] == []
    assert client.get("/v1/batches", headers=auth("team-b")).json()["data"] == []
    assert client.get(f"/v1/files/{file_a['id']}", headers=auth("team-a")).status_code == 200


def test_a_tenants_lines_count_to_it(client):
    registry = context_of(client.app).registry

    def tokens(tenant: str) -> float:
        return registry.get_sample_value("appliance_tenant_tokens_total",
                                         {"tenant": tenant, "kind": "completion"}) or 0.0

    run_batch(client, [chat_line(f"l{i}") for i in range(4)], "team-b")
    assert tokens("team-b") == 4 * 3 and tokens("team-a") == 0
    assert registry.get_sample_value("appliance_batch_lines_answered_total",
                                     {"tenant": "team-b", "result": "output"}) == 4


def test_files_can_be_deleted(client):
    file = upload(client, jsonl([chat_line("a")])).json()
    deleted = client.delete(f"/v1/files/{file['id']}", headers=auth("team-a"))
    assert deleted.json() == {"id": file["id"], "object": "file", "deleted": True}
    openai_error(client.get(f"/v1/files/{file['id']}", headers=auth("team-a")), 404, "file_not_found")
    openai_error(client.delete(f"/v1/files/{file['id']}", headers=auth("team-a")), 404, "file_not_found")


# -- bad input: OpenAI's error JSON, a 4xx, never a 500 ------------------------------------------------------------


def test_bad_uploads_are_refused(make_batch_client):
    client = make_batch_client(batch={"max_file_bytes": 4096})
    openai_error(upload(client, jsonl([chat_line("a")]), purpose="fine-tune"), 400, "invalid_purpose")
    openai_error(upload(client, b"x" * 4097), 400, "file_too_large")
    huge = upload(client, b"x" * (4096 + (1 << 20) + 1))  # past the upload's own body limit: refused unread
    assert "batch.max_file_bytes" in openai_error(huge, 413, "request_too_large")["message"]
    openai_error(upload(client, b"\n \n"), 400, "empty_file")
    no_file = client.post("/v1/files", data={"purpose": "batch"}, headers=auth("team-a"))
    openai_error(no_file, 400)
    openai_error(client.post("/v1/files", json={"purpose": "batch"}, headers=auth("team-a")), 400)
    openai_error(client.post("/v1/files", files={"file": ("x", b"{}")}, data={"purpose": "batch"}), 401)


@pytest.mark.parametrize(("lines", "extra", "status", "code"), [
    ([{**chat_line("a"), "url": "/v1/embeddings"}], {}, 400, "invalid_url"),
    ([chat_line("a", model="gpt-4o")], {}, 400, "model_not_found"),
    ([chat_line("a"), chat_line("a")], {}, 400, "duplicate_custom_id"),
    ([chat_line("a")], {"endpoint": "/v1/embeddings"}, 400, "invalid_endpoint"),
    ([chat_line("a")], {"completion_window": "1w"}, 400, "invalid_completion_window"),
    ([chat_line("a")], {"completion_window": "25h"}, 400, "invalid_completion_window"),
    ([chat_line("a")], {"input_file_id": "file-000000000000000000000000"}, 404, "file_not_found"),
    ([chat_line("a")], {"metadata": {f"k{i}": "v" for i in range(17)}}, 400, None),
    ([chat_line("a")], {"input_file_id": 5}, 400, None),
])
def test_bad_batches_are_refused_and_nothing_is_kept(client, lines, extra, status, code):
    file = upload(client, jsonl(lines)).json()
    body = {"input_file_id": file["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h", **extra}
    openai_error(client.post("/v1/batches", json=body, headers=auth("team-a")), status, code)
    assert client.get("/v1/batches", headers=auth("team-a")).json()["data"] == []


def test_an_output_file_is_no_batch_input(client):
    batch = run_batch(client, [chat_line("a")])
    openai_error(create(client, batch["output_file_id"]), 400, "invalid_purpose")


def test_unknown_ids_and_bad_queries_are_4xx(client):
    openai_error(client.get("/v1/batches/batch_nope", headers=auth("team-a")), 404, "batch_not_found")
    openai_error(client.get("/v1/files/file-nope/content", headers=auth("team-a")), 404, "file_not_found")
    openai_error(client.get("/v1/batches?limit=0", headers=auth("team-a")), 400)
    openai_error(client.get("/v1/files?order=sideways", headers=auth("team-a")), 400)
    openai_error(client.get("/admin/batches?status=asleep", headers={"authorization": f"Bearer {ADMIN}"}), 400)


def test_the_api_is_404_when_off(make_batch_client):
    client = make_batch_client(batch={"enabled": False})
    openai_error(upload(client, jsonl([chat_line("a")])), 404, "batch_api_off")
    openai_error(client.get("/v1/batches", headers=auth("team-a")), 404, "batch_api_off")


# -- cancel and the operator's view ---------------------------------------------------------------------------------


def test_a_cancelled_batch_keeps_what_was_answered(make_batch_client, stubs):
    client = make_batch_client(batch={"max_concurrency": 1})
    for stub in stubs:
        stub.first_token_delay = 0.3  # a whole answer takes this long
    file = upload(client, jsonl([chat_line(f"c{i}") for i in range(6)])).json()
    batch_id = create(client, file["id"]).json()["id"]
    wait_for(client, batch_id, statuses=("in_progress",))
    deadline_batch = wait_for_counts(client, batch_id, completed=1)
    assert deadline_batch["status"] == "in_progress"
    cancelled = client.post(f"/v1/batches/{batch_id}/cancel", headers=auth("team-a"))
    assert cancelled.status_code == 200 and cancelled.json()["status"] in ("cancelling", "cancelled")
    batch = wait_for(client, batch_id)
    assert batch["status"] == "cancelled" and batch["cancelled_at"] >= batch["cancelling_at"]
    outputs = result_lines(client, batch["output_file_id"])
    errors = result_lines(client, batch["error_file_id"])
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert sorted(line["custom_id"] for line in outputs + errors) == sorted(f"c{i}" for i in range(6))
    assert batch["request_counts"] == {"total": 6, "completed": len(outputs), "failed": len(errors)}
    again = client.post(f"/v1/batches/{batch_id}/cancel", headers=auth("team-a"))
    assert again.status_code == 200 and again.json()["status"] == "cancelled"
    done = run_batch(client, [chat_line("x")])
    openai_error(client.post(f"/v1/batches/{done['id']}/cancel", headers=auth("team-a")), 409,
                 "batch_not_cancellable")


def wait_for_counts(client, batch_id: str, completed: int) -> dict:
    import time

    deadline = time.monotonic() + 10
    while True:
        batch = client.get(f"/v1/batches/{batch_id}", headers=auth("team-a")).json()
        if batch["request_counts"]["completed"] >= completed:
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.02)


def test_the_operator_sees_every_tenants_batches(client):
    batch_a = run_batch(client, [chat_line("a")], "team-a")
    batch_b = run_batch(client, [chat_line("b")], "team-b")
    admin = {"authorization": f"Bearer {ADMIN}"}
    listed = client.get("/admin/batches", headers=admin).json()
    assert [(b["id"], b["tenant"]) for b in listed["data"]] == [(batch_b["id"], "team-b"), (batch_a["id"], "team-a")]
    only_a = client.get("/admin/batches?tenant=team-a&status=completed", headers=admin).json()["data"]
    assert [b["id"] for b in only_a] == [batch_a["id"]]
    assert client.get(f"/admin/batches/{batch_b['id']}", headers=admin).json()["tenant"] == "team-b"
    openai_error(client.get("/admin/batches", headers=auth("team-a")), 401)
    assert "tenant" not in client.get(f"/v1/batches/{batch_a['id']}", headers=auth("team-a")).json()


def test_the_metrics_describe_the_batches(client):
    run_batch(client, [chat_line("a"), "oops"], "team-a")

    def metrics() -> str:
        return client.get("/metrics", headers={"authorization": f"Bearer {ADMIN}"}).text

    assert wait_until(lambda: 'appliance_batches{status="completed",tenant="team-a"} 1.0' in metrics())
    text = metrics()
    assert 'appliance_batches{status="in_progress",tenant="team-a"} 0.0' in text
    assert 'appliance_batch_lines_answered_total{result="output",tenant="team-a"} 1.0' in text
    assert 'appliance_batch_tokens_total{kind="completion",tenant="team-a"} 3.0' in text
    assert 'appliance_batch_lines_given_back_total{reason="preempted"} 0.0' in text


def test_nothing_is_written_until_the_first_upload(client, tmp_path):
    assert client.get("/v1/batches", headers=auth("team-a")).json()["data"] == []
    assert not (tmp_path / "batch").exists()
    upload(client, jsonl([chat_line("a")]))
    assert (tmp_path / "batch" / "batch.sqlite3").exists()


def test_upload_bodies_are_the_only_ones_past_max_request_bytes(client):
    big = json.dumps({"model": "demo", "messages": [{"role": "user", "content": "x" * (1 << 20)}]})
    response = client.post("/v1/chat/completions", content=big, headers={**auth("team-a"),
                                                                         "content-type": "application/json"})
    assert "max_request_bytes" in openai_error(response, 413, "request_too_large")["message"]


def test_no_upload_exceeds_the_body_budget(make_batch_client):
    client = make_batch_client(intake={"body_budget_bytes": 1 << 20})  # below batch.max_file_bytes: no error at start
    huge = upload(client, b"x" * ((1 << 20) + 1))
    assert "intake.body_budget_bytes" in openai_error(huge, 413, "request_too_large")["message"]
    assert upload(client, jsonl([chat_line("a")])).status_code == 200


def test_a_restarted_appliance_resumes_its_batches(replicas, stubs, tmp_path):
    from fastapi.testclient import TestClient

    from appliance.app import create_app
    from tests.batch.conftest import settings

    for stub in stubs:
        stub.first_token_delay = 0.2
    with TestClient(create_app(settings(tmp_path, batch={"max_concurrency": 1}), replicas=lambda: replicas)) as first:
        file_id = upload(first, jsonl([chat_line(f"r{i}") for i in range(8)])).json()["id"]
        batch_id = create(first, file_id).json()["id"]
        wait_for_counts(first, batch_id, completed=2)
    # stopped mid-batch: the line in flight was given back
    with TestClient(create_app(settings(tmp_path), replicas=lambda: replicas)) as second:
        batch = wait_for(second, batch_id)
        assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 8
        assert [line["custom_id"] for line in result_lines(second, batch["output_file_id"])] == [
            f"r{i}" for i in range(8)]
