"""The JSON envelope of every stored value: ``{"schema": N, "data": <payload>}``.

The schema version lets a newer release change a payload without an older one misreading it.
Values are never pickled.
"""

from __future__ import annotations

import json
from typing import Final, TypeAlias

from elastic_allreduce.errors import MalformedValueError

JsonValue: TypeAlias = bool | int | float | str | list["JsonValue"] | dict[str, "JsonValue"] | None

SCHEMA_VERSION: Final = 1


def encode(value: JsonValue) -> bytes:
    """Wrap a JSON payload in the envelope; raises TypeError for non-JSON values."""
    return json.dumps(
        {"schema": SCHEMA_VERSION, "data": value}, separators=(",", ":"), allow_nan=False
    ).encode()


def as_int(value: JsonValue, default: int) -> int:
    """``value`` if it is an int (not a bool), else ``default`` (for optional stored fields)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def decode(key: str, raw: bytes) -> JsonValue:
    """Unwrap a stored value; raises MalformedValueError saying what is wrong with it."""
    try:
        envelope = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MalformedValueError(key, f"not UTF-8 JSON ({exc}): {raw[:80]!r}") from exc
    if not isinstance(envelope, dict) or "schema" not in envelope or "data" not in envelope:
        raise MalformedValueError(
            key, f'expected an object {{"schema": {SCHEMA_VERSION}, "data": ...}}, got {raw[:80]!r}'
        )
    schema = envelope["schema"]
    if schema != SCHEMA_VERSION:
        raise MalformedValueError(
            key,
            f"schema version {schema!r}; this elastic-allreduce reads version {SCHEMA_VERSION} "
            "(was the key written by another release? run the same version everywhere)",
        )
    data: JsonValue = envelope["data"]
    return data
