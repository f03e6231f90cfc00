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
