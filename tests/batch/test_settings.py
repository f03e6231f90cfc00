"""The batch section's PostgreSQL settings: the password only from a file and never shown, a URL that is
PostgreSQL's, and a claim that outlasts any request."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from appliance.batch.settings import BatchSettings
from appliance.config_view import config_dump
from appliance.settings import Settings

URL = "postgresql://appliance@db.example:5432/appliance"


def test_the_password_comes_from_its_file_and_is_never_dumped(tmp_path):
    (tmp_path / "password").write_text("s3cret-pw\n")
    section = BatchSettings(database_url=URL, database_password_file=tmp_path / "password")
    assert section.database_password == "s3cret-pw"
    settings = Settings(batch=section.model_dump())
    assert "s3cret-pw" not in settings.model_dump_json() and "s3cret-pw" not in str(config_dump(settings))


@pytest.mark.parametrize(("url", "message"), [
    ("postgresql://appliance:pw@db.example/appliance", "password_file"),
    ("postgresql://appliance@db.example/appliance?password=pw", "password_file"),
    ("mysql://appliance@db.example/appliance", "postgresql://"),
])
def test_a_url_holding_a_password_or_not_postgres_is_refused(url, message):
    with pytest.raises(ValidationError, match=message):
        BatchSettings(database_url=url)


def test_an_empty_url_is_unset_and_a_missing_password_file_is_named(tmp_path):
    assert BatchSettings(database_url="", database_password_file="").database_url is None
    with pytest.raises(ValidationError, match="batch.database_password_file"):
        BatchSettings(database_url=URL, database_password_file=tmp_path / "missing")


def test_a_claim_must_outlast_a_request():
    with pytest.raises(ValidationError, match="claim_seconds"):
        Settings(batch={"database_url": URL, "claim_seconds": 600}, gateway={"request_timeout_seconds": 600})
    Settings(batch={"database_url": URL, "claim_seconds": 601}, gateway={"request_timeout_seconds": 600})
    Settings(batch={"claim_seconds": 60})  # SQLite: no claims, nothing to check
