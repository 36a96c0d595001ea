"""A chat's own settings: what it changes from the user's preferences, nothing more.

Each field is None when the chat uses the default (the preference of the same
name). The KV preference's own "Off" is `KV_OFF`, since None already means
"the default". Stored as the conversation's columns (sessions.db, m004); the
one rule that applies them to a turn is `Preferences.for_chat`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from sessions.db import CHAT_OVERRIDE_COLUMNS

KV_OFF = 16  # full precision, as a chat's own choice (not "the default")


@dataclass(frozen=True)
class ChatOverrides:
    temperature: float | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None
    kv_bits: int | None = None  # KV_OFF, 8 or 4; None: the default

    @classmethod
    def from_row(cls, row: dict) -> ChatOverrides:
        """A damaged value (text, NaN, a number of the wrong kind) reads as the default."""
        values = {}
        for field in fields(cls):
            kind = CHAT_OVERRIDE_COLUMNS[field.name]
            value = row.get(field.name)
            if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
                values[field.name] = float(value) if math.isfinite(value) else None
            elif kind is int and isinstance(value, int) and not isinstance(value, bool):
                values[field.name] = value
        return cls(**values)

    def columns(self) -> dict:
        """Every field as its column, None included (a reset stores NULL)."""
        return {field.name: getattr(self, field.name) for field in fields(self)}

    def given(self) -> dict:
        """Only the fields this chat sets."""
        return {k: v for k, v in self.columns().items() if v is not None}

    def merged(self, newer: ChatOverrides) -> ChatOverrides:
        """These, with each field `newer` sets in place of this one's."""
        return ChatOverrides(**{**self.given(), **newer.given()})
