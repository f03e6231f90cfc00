"""Argument types for every command: a bad value is an argparse error (exit 2, a usage line, no traceback)."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def non_negative_int(text: str) -> int:
    return 0 if text.strip() == "0" else positive_int(text)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{value} must be a positive number")
    return value


def non_negative_float(text: str) -> float:
    return 0.0 if text.strip() in ("0", "0.0") else positive_float(text)


def fraction(text: str) -> float:
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{value} must be within (0, 1]")
    return value


def confidence(text: str) -> float:
    value = fraction(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"{value} must be below 1")
    return value


def int_list(text: str) -> tuple[int, ...]:
    return tuple(positive_int(part) for part in text.split(",") if part.strip())


