"""User preferences, stored in SQLite, typed, with every default in one place."""

from __future__ import annotations

import json
from typing import Any

import sqlite_utils

from sessions.errors import UserError

DEFAULTS: dict[str, Any] = {
    "model": None,  # None: the starter model, or the first installed
    "system_prompt": "",
    "temperature": 0.7,
    "top_p": 0.95,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "max_tokens": 1024,
    "kv_bits": None,  # None (16-bit), 8 or 4
    "kv_group_size": 64,
    "quantized_kv_start": 0,
    "max_context": None,  # None: the model's own
    "cache_budget_bytes": 10 * 2**30,
    "cache_chunk_tokens": 256,
}


class Settings:
    def __init__(self, db: sqlite_utils.Database) -> None:
        self.db = db

    def get(self, key: str) -> Any:
        if key not in DEFAULTS:
            raise KeyError(key)
        rows = list(self.db["settings"].rows_where("key = ?", [key]))
        return json.loads(rows[0]["value"]) if rows else DEFAULTS[key]

    def set(self, key: str, value: Any) -> None:
        if key not in DEFAULTS:
            raise UserError(f"Unknown setting {key!r}")
        default = DEFAULTS[key]
        if default is not None and value is not None:
            try:
                value = type(default)(value)
            except (TypeError, ValueError) as exc:
                raise UserError(f"{key} must be a {type(default).__name__}: {exc}") from exc
        self.db["settings"].upsert({"key": key, "value": json.dumps(value)}, pk="key")

    def all(self) -> dict[str, Any]:
        values = dict(DEFAULTS)
        for row in self.db["settings"].rows:
            if row["key"] in DEFAULTS:
                values[row["key"]] = json.loads(row["value"])
        return values
