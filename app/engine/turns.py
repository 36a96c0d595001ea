"""What a stored turn is asked with and what it answers: plain data, no mlx."""

from __future__ import annotations

from dataclasses import dataclass, field

from app.engine.chat import Event
from app.engine.errors import UserError
from app.engine.generation import KVSettings, SamplingSettings, TurnStats
from app.engine.kvstore import SaveReport


@dataclass(frozen=True)
class TurnOptions:
    system: str | None = None
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    kv: KVSettings = field(default_factory=KVSettings)
    max_context: int | None = None  # None: the model's own


@dataclass(frozen=True)
class CacheSaved:
    report: SaveReport
    error: str | None = None


@dataclass(frozen=True)
class RestoreInfo:
    source: str = "recompute"  # "memory", "disk", "recompute"
    seconds: float = 0.0
    bytes_read: int = 0
    tokens: int = 0
    estimate_restore_s: float | None = None
    estimate_recompute_s: float | None = None
    rejected: str | None = None
    checkpoint: int | None = None  # the snapshot restored, counting from 1 (snapshots only)
    prompt_tokens: int = 0  # the turn's whole prompt, of which `tokens` were ready
    held_tokens: int = 0  # what memory held before the turn, of which it kept `tokens`
    raced: bool = False  # read beside recomputing, the first in taken (restore_race.py)

    def to_stats(self) -> dict:
        return {
            "restore_source": self.source,
            "restore_s": round(self.seconds, 4),
            "restore_bytes": self.bytes_read,
            "restored_tokens": self.tokens,
            "estimate_restore_s": self.estimate_restore_s,
            "estimate_recompute_s": self.estimate_recompute_s,
            "cache_rejected": self.rejected,
            "restore_checkpoint": self.checkpoint,
            "restore_raced": self.raced,
        }


@dataclass(frozen=True)
class ReplyFinished:
    """A stored turn's reply, complete or stopped: the engine's stats for it, where its
    cache came from, and the message it was stored as."""

    text: str
    stats: TurnStats
    restore: RestoreInfo
    conversation_id: int
    message_id: int

    @property
    def ttft_s(self) -> float:
        """What the user waited for the first token: the restore too (a raced one is
        within the turn's own time: it ran beside the prefill)."""
        return (0.0 if self.restore.raced else self.restore.seconds) + self.stats.ttft_s

    def to_dict(self) -> dict:
        return {
            **self.stats.to_dict(),
            **self.restore.to_stats(),
            "ttft_s": round(self.ttft_s, 4),
            "conversation_id": self.conversation_id,
            "message_id": self.message_id,
        }


TurnEvent = Event | RestoreInfo | ReplyFinished | CacheSaved


class NotAReply(UserError):
    pass
