"""User preferences as stored: one JSON value per key in the `settings` table.

What the keys are, their defaults and their validation live in one place above
this layer (`app.service.preferences.Preferences`); this module only stores.
"""

from __future__ import annotations

import json
from typing import Any

import sqlite_utils


class Settings:
    def __init__(self, db: sqlite_utils.Database) -> None:
        self.db = db

    def read(self) -> dict[str, Any]:
        """Every stored value; a row that is not JSON is skipped (its default applies)."""
        values = {}
        for row in self.db["settings"].rows:
            try:
                values[row["key"]] = json.loads(row["value"])
            except (TypeError, ValueError):
                continue
        return values

    def write(self, values: dict[str, Any]) -> None:
        rows = [{"key": key, "value": json.dumps(value)} for key, value in values.items()]
        with self.db.conn:
            self.db["settings"].upsert_all(rows, pk="key")
