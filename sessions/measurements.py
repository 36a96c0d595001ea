"""Running estimates the reopen planner needs: read bandwidth, prefill rates."""

from __future__ import annotations

import math

import sqlite_utils

from sessions.cachefiles import now

# Weight of the newest observation in the running average.
_NEW_WEIGHT = 0.5


class Measurements:
    def __init__(self, db: sqlite_utils.Database) -> None:
        self.db = db

    def get(self, key: str) -> float | None:
        rows = list(self.db["measurements"].rows_where("key = ?", [key]))
        return _estimate(rows[0]["value"]) if rows else None

    def starting_with(self, prefix: str) -> dict[str, float]:
        """Every estimate whose key starts with `prefix` (compared as text, not a pattern)."""
        rows = self.db["measurements"].rows_where("substr(key, 1, ?) = ?", [len(prefix), prefix])
        found = {row["key"]: _estimate(row["value"]) for row in rows}
        return {key: value for key, value in found.items() if value is not None}

    def observe(self, key: str, value: float) -> float:
        """Blend `value` into the running estimate for `key`; return the new estimate."""
        old = self.get(key)
        new = value if old is None else (1 - _NEW_WEIGHT) * old + _NEW_WEIGHT * value
        self.db["measurements"].upsert({"key": key, "value": new, "updated": now()}, pk="key")
        return new

    def forget(self, key: str) -> None:
        """Drop the estimate for `key`: the next observation starts it afresh."""
        self.db["measurements"].delete_where("key = ?", [key])


def _estimate(value: object) -> float | None:
    """A stored estimate, if it is one: another program (or a damaged file) can store
    anything in the column, and the planner divides by it."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if number and math.isfinite(value) and value > 0 else None
