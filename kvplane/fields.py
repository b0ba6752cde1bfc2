"""Typed reads of optional fields of a JSON request body, shared by the router's and the
simulator's request parsers (each words the 400 its own way: OpenAI's shape for the
router, vLLM's validation message for the simulator)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class FieldTypeError(ValueError):
    """``key`` holds a value that is not ``expected`` (a type name: boolean, integer)."""

    def __init__(self, key: str, expected: str) -> None:
        super().__init__(f"{key}: expected {expected}")
        self.key, self.expected = key, expected


def opt_bool(obj: Mapping[str, Any], key: str, default: bool) -> bool:
    v = obj.get(key)
    if v is None:
        return default
    if type(v) is not bool:
        raise FieldTypeError(key, "boolean")
    return v


def opt_int(obj: Mapping[str, Any], key: str) -> int | None:
    """An integer (never a boolean), or None when absent or null."""
    v = obj.get(key)
    if v is None:
        return None
    if type(v) is not int:
        raise FieldTypeError(key, "integer")
    return v
