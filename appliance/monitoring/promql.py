"""PromQL as the dashboards write it, made concrete: Grafana's variables substituted, metric names extracted.

Grafana expands ``$__rate_interval``, ``$replica`` and friends before a query reaches Prometheus. Tests (promtool
validation, the metric-name contract) and ``appliance snapshot`` need the same expansion without Grafana, so it
lives here, once.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from prometheus_client.utils import floatToGoString

DEFAULT_VARIABLES: Mapping[str, str] = {"replica": ".*", "model": ".*", "tenant": ".*"}

# Words that look like metric names but are PromQL syntax.
KEYWORDS = frozenset({
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
    "inf", "nan", "atan2", "start", "end",
})
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![\w.:])([a-zA-Z_:][\w:]*)(\s*\()?")


def bucket_label(seconds: float) -> str:
    """The ``le`` label of a histogram bucket bound exactly as prometheus_client exposes it (0.8 -> "0.8",
    1 -> "1.0"): what a selector of that one bucket must match."""
    label: str = floatToGoString(float(seconds))
    return label


def substitute(expr: str, *, rate_interval: str = "5m", variables: Mapping[str, str] | None = None) -> str:
    """``expr`` with Grafana's variables replaced: ``$__rate_interval`` by ``rate_interval``, template
    variables by their value (default ``.*``, Grafana's "All" for a regex matcher). Unknown variables are an
    error, so a typo in a dashboard fails a test instead of reaching Prometheus as literal text."""
    values = {**DEFAULT_VARIABLES, **(variables or {}), "__rate_interval": rate_interval,
              "__interval": rate_interval}

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise ValueError(f"unknown Grafana variable ${name} in {expr!r}")
        return values[name]

    return _VARIABLE.sub(replace, expr)


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (functions, keywords, label names and durations excluded)."""
    text = _STRING.sub('""', expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    names = set()
    for match in _IDENT.finditer(text):
        name, call = match.group(1), match.group(2)
        if call or name in KEYWORDS:
            continue
        names.add(name)
    return names


def rate_windows(expr: str) -> list[str]:
    """The range of every ``rate``/``irate``/``increase``/``changes`` call (what ``[...]`` says)."""
    return re.findall(r"\b(?:rate|irate|increase|changes|delta|deriv)\s*\([^\[]*\[([^\]]*)\]", expr)
