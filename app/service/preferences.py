"""The user's preferences: one value, its defaults and its validation, in one place.

The window's Preferences dialog and the terminal's flags both end in a
`Preferences`: the terminal starts from the saved ones and lets a flag override
a field (`with_overrides`), so `reprise chat` answers as the window would.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from app.engine.generation import KVSettings, SamplingSettings
from app.engine.kvscheme import GROUP_SIZES, PREFERENCE_BITS
from sessions.errors import UserError
from sessions.overrides import KV_OFF, ChatOverrides
from sessions.settings import Settings

if TYPE_CHECKING:
    from app.engine.turns import TurnOptions

log = logging.getLogger(__name__)

# Every value the Memory preference offers: None keeps the model's precision.
KV_CHOICES: tuple[int | None, ...] = (None, *PREFERENCE_BITS)
# The window's colours: "system" follows the desktop's light or dark setting as it changes.
THEME_CHOICES: tuple[str, ...] = ("system", "light", "dark")


class InvalidPreference(UserError):
    pass


@dataclass(frozen=True)
class Preferences:
    model: str | None = None  # None: the starter model, or the first installed
    system_prompt: str = ""
    temperature: float = 0.7
    top_p: float = 0.95
    min_p: float = 0.0
    # Off (1.0), the starter model loops: 4 of 24 sampled replies and its greedy poem;
    # 1.1, none (docs/probes/repetition_probe.py). Ollama and LM Studio start at 1.1 too.
    repetition_penalty: float = 1.1
    max_tokens: int = 1024
    seed: int | None = None  # a terminal flag; the window samples freely
    kv_bits: int | None = None
    kv_group_size: int = 64
    quantized_kv_start: int = 0
    max_context: int | None = None  # None: the model's own
    cache_budget_bytes: int = 10 * 10**9  # 10 GB, as Preferences says it
    cache_chunk_tokens: int = 256
    theme: str = "system"

    def __post_init__(self) -> None:
        for name, ok, rule in _RULES:
            if not ok(getattr(self, name)):
                raise InvalidPreference(f"{name.replace('_', ' ')} must be {rule}")

    # -- from and to storage -----------------------------------------------------

    @classmethod
    def from_stored(cls, values: dict[str, Any]) -> Preferences:
        """The saved preferences; a stored value that is not valid (an older version's,
        or a damaged row) gives way to its default, with a line in the log."""
        prefs = cls()
        for field in fields(cls):
            if field.name not in values:
                continue
            try:
                prefs = replace(prefs, **{field.name: _coerce(field.name, values[field.name])})
            except (InvalidPreference, TypeError, ValueError):
                log.warning("ignoring the saved %s %r", field.name, values[field.name])
        return prefs

    @classmethod
    def load(cls, settings: Settings) -> Preferences:
        return cls.from_stored(settings.read())

    def save(self, settings: Settings) -> None:
        settings.write(asdict(self))

    def with_overrides(self, **changes: Any) -> Preferences:
        """These preferences with every change that is not None (a flag not given)."""
        given = {k: _coerce(k, v) for k, v in changes.items() if v is not None}
        return replace(self, **given)

    def for_chat(self, overrides: ChatOverrides) -> Preferences:
        """The one rule for a chat's own settings: each one it sets replaces the
        preference of the same name for its turns (the system prompt has its own rule,
        `Conversation.system_for`). A stored value that is not valid is left out."""
        prefs = self
        for name, value in overrides.given().items():
            try:
                prefs = replace(prefs, **{name: _chat_value(name, value)})
            except (InvalidPreference, TypeError, ValueError):
                log.warning("ignoring a chat's own %s %r", name, value)
        return prefs

    def check_chat(self, overrides: ChatOverrides) -> ChatOverrides:
        """`overrides` if every value is one the preferences accept; else
        `InvalidPreference` saying which is not."""
        for name, value in overrides.given().items():
            replace(self, **{name: _chat_value(name, value)})
        return overrides

    # -- what they mean to the engine ---------------------------------------------

    def turn_options(self) -> TurnOptions:
        # Imported here: the window reads preferences before the engine (mlx) is loaded.
        from app.engine.turns import TurnOptions

        return TurnOptions(
            system=self.system_prompt or None,
            sampling=SamplingSettings(
                temperature=self.temperature,
                top_p=self.top_p,
                min_p=self.min_p,
                repetition_penalty=self.repetition_penalty,
                max_tokens=self.max_tokens,
                seed=self.seed,
            ),
            kv=KVSettings(self.kv_bits, self.kv_group_size, self.quantized_kv_start),
            max_context=self.max_context,
        )


def _finite(low: float, high: float):
    return lambda v: isinstance(v, int | float) and math.isfinite(v) and low <= v <= high


def _whole(low: int, high: float = math.inf, optional: bool = False):
    def ok(v) -> bool:
        if v is None:
            return optional
        return isinstance(v, int) and not isinstance(v, bool) and low <= v <= high

    return ok


_RULES = (
    ("model", lambda v: v is None or (isinstance(v, str) and v.strip() != ""), "a model name"),
    ("system_prompt", lambda v: isinstance(v, str), "text"),
    ("temperature", _finite(0.0, 5.0), "a number from 0 to 5"),
    ("top_p", _finite(0.0, 1.0), "a number from 0 to 1"),
    ("min_p", _finite(0.0, 1.0), "a number from 0 to 1"),
    ("repetition_penalty", _finite(0.1, 10.0), "a number from 0.1 to 10"),
    ("max_tokens", _whole(1, 1_000_000), "a whole number of at least 1"),
    ("seed", _whole(0, optional=True), "a whole number of at least 0"),
    ("kv_bits", lambda v: v in KV_CHOICES, f"one of {', '.join(map(str, KV_CHOICES))}"),
    ("kv_group_size", lambda v: v in GROUP_SIZES, f"one of {', '.join(map(str, GROUP_SIZES))}"),
    ("quantized_kv_start", _whole(0), "a whole number of at least 0"),
    ("max_context", _whole(16, optional=True), "a whole number of at least 16"),
    ("cache_budget_bytes", _whole(0), "a whole number of bytes"),
    ("cache_chunk_tokens", _whole(16, 65_536), "a whole number from 16 to 65536"),
    ("theme", lambda v: v in THEME_CHOICES, f"one of {', '.join(THEME_CHOICES)}"),
)


def _chat_value(name: str, value: Any) -> Any:
    """A chat's own value as the preference's: its "Off" for the KV setting is None."""
    return None if name == "kv_bits" and value == KV_OFF else _coerce(name, value)


def _coerce(name: str, value: Any) -> Any:
    """JSON keeps 1.0 as 1 and a flag may give 0: floats where the field is a float."""
    default = getattr(Preferences, name)
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value
