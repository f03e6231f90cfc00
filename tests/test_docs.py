"""The docs stay true: every settings key is documented, and nothing documented is gone."""

import re
from pathlib import Path

from pydantic import BaseModel

from appliance.settings import Settings

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def setting_keys(model: type[BaseModel] = Settings, prefix: str = "") -> set[str]:
    keys = set()
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys |= setting_keys(annotation, f"{prefix}{name}.")
        else:
            keys.add(prefix + name)
    return keys


def test_every_setting_is_documented_and_every_documented_key_exists():
    documented = set(re.findall(r"^\| `([a-z0-9_.]+)` \|", DOC.read_text(), re.M))
    assert setting_keys() - documented == set(), "undocumented settings"
    assert documented - setting_keys() == set(), "documented settings that do not exist"


README = DOC.parents[1] / "README.md"


def test_the_readme_commands_table_lists_every_command():
    import argparse

    from appliance.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    text = README.read_text()
    table = text[text.index("## Commands"):].split("\n## ")[0]
    rows = [line for line in table.splitlines() if line.startswith("| `appliance ")]
    listed = {word for row in rows for word in re.findall(r"[a-z][a-z-]+", row.split("|")[1])}
    assert set(commands) - listed == set(), "commands missing from README.md's table"


def test_the_readme_opens_with_the_two_commands_then_what_you_get():
    """The first screen: the commands to run, then the URLs they bring up, then how to serve one's own model."""
    text = README.read_text()
    first = text.index("make up")
    for later in ("make test", "http://127.0.0.1:8000/v1", ":9090", ":9093", "APPLIANCE_MODEL="):
        assert first < text.index(later), later
    assert text.index("APPLIANCE_MODEL=") < text.index("download.pytorch.org")  # the wheel detail comes later
    assert len(text[:text.index("APPLIANCE_MODEL=")].splitlines()) < 45


def test_the_earlier_names_table_lists_every_alias():
    """Issue 22: every top-level key that moved into a section is still accepted; the docs say where it went."""
    from appliance.settings import FLAT_ALIASES

    table = DOC.read_text().split("## Earlier names", 1)[1]
    rows = set(re.findall(r"^\| `([a-z0-9_.]+)` \| `([a-z0-9_]+)` \| `(APPLIANCE_[A-Z0-9_]+)` \|$", table, re.M))
    expected = {(f"{section}.{key}", flat, f"APPLIANCE_{flat.upper()}")
                for flat, (section, key) in FLAT_ALIASES.items()}
    assert rows == expected
