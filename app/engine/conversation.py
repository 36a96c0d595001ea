"""Turns in stored conversations: messages in SQLite, the KV cache on disk.

`ConversationEngine` is what the terminal and the GUI worker drive. For each
turn it commits the user's message, decides where the KV cache comes from
(`memory` when this process just ran the conversation, `disk` when the
planner says restoring beats recomputing and the files pass every check,
`recompute` otherwise), streams the reply into the database, and after the
reply is complete saves the cache's new chunks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import sqlite_utils

from app.engine.chat import ChatSession, Event
from app.engine.generation import KVSettings, SamplingSettings, TextDelta, TurnFinished
from app.engine.kvscheme import scheme_for, usable_format
from app.engine.kvstore import SNAPSHOT, KVStore, SaveReport
from app.engine.loading import LoadedModel
from sessions.cachefiles import CacheIndex, DiskFull
from sessions.conversations import ConversationStore, ReplyWriter
from sessions.measurements import Measurements

READ_BANDWIDTH = "read_bytes_per_s"
# Below this many tokens the planner does not bother: restoring is always cheap.
_MEASURE_MIN_TOKENS = 64


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


@dataclass
class RestoreInfo:
    source: str = "recompute"  # "memory", "disk", "recompute"
    seconds: float = 0.0
    bytes_read: int = 0
    tokens: int = 0
    estimate_restore_s: float | None = None
    estimate_recompute_s: float | None = None
    rejected: str | None = None

    def to_stats(self) -> dict:
        return {
            "restore_source": self.source,
            "restore_s": round(self.seconds, 4),
            "restore_bytes": self.bytes_read,
            "restored_tokens": self.tokens,
            "estimate_restore_s": self.estimate_restore_s,
            "estimate_recompute_s": self.estimate_recompute_s,
            "cache_rejected": self.rejected,
        }


class ConversationEngine:
    def __init__(
        self,
        db: sqlite_utils.Database,
        loaded: LoadedModel,
        chunk_tokens: int = 256,
        budget_bytes: int | None = None,
    ) -> None:
        self.store = ConversationStore(db)
        self.index = CacheIndex(db)
        self.kvstore = KVStore(self.index, loaded, chunk_tokens)
        self.measurements = Measurements(db)
        self.session = ChatSession(loaded)
        self.loaded = loaded
        self.budget_bytes = budget_bytes
        self._in_memory: int | None = None  # the conversation whose cache `session` holds

    # -- the three ways to get a reply ----------------------------------------

    def send(
        self,
        conversation_id: int,
        text: str,
        options: TurnOptions,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> Iterator[Event | RestoreInfo | CacheSaved]:
        conversation = self.store.get(conversation_id)
        user = self.store.add_message(
            conversation_id, "user", text, parent_id=conversation.current_message_id
        )
        yield from self._reply(conversation_id, user.id, options, should_stop)

    def regenerate(
        self,
        conversation_id: int,
        options: TurnOptions,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> Iterator[Event | RestoreInfo | CacheSaved]:
        """A new sibling of the last reply (the old one stays, as another branch)."""
        messages = self.store.get(conversation_id).messages
        if not messages:
            return
        last = messages[-1]
        parent = last.parent_id if last.role == "assistant" else last.id
        yield from self._reply(conversation_id, parent, options, should_stop)

    def edit(
        self,
        message_id: int,
        text: str,
        options: TurnOptions,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> Iterator[Event | RestoreInfo | CacheSaved]:
        """A new sibling of a user message with `text`, and a reply to it."""
        original = self.store.message(message_id)
        edited = self.store.add_message(
            original.conversation_id, "user", text, parent_id=original.parent_id
        )
        yield from self._reply(original.conversation_id, edited.id, options, should_stop)

    # -- one turn --------------------------------------------------------------

    def _reply(
        self,
        conversation_id: int,
        parent_id: int,
        options: TurnOptions,
        should_stop: Callable[[], bool],
    ) -> Iterator[Event | RestoreInfo | CacheSaved]:
        self.store.update_settings(conversation_id, current_message_id=parent_id)
        conversation = self.store.get(conversation_id)
        system = options.system if options.system is not None else conversation.system_prompt
        messages = conversation.chat_messages()

        def render(known: Sequence[int]) -> list[int]:
            return self.session.render(messages, system, known=known)

        restore = self._prepare_cache(conversation_id, render, options.kv)
        yield restore
        prompt = render(self.session.tokens)

        reply = self.store.add_message(
            conversation_id, "assistant", "", parent_id=parent_id, state="streaming"
        )
        writer = ReplyWriter(self.store, reply.id)
        try:
            for event in self.session.generate(
                prompt,
                sampling=options.sampling,
                kv=options.kv,
                should_stop=should_stop,
                max_context=options.max_context,
            ):
                if isinstance(event, TextDelta):
                    writer.append(event.text)
                elif isinstance(event, TurnFinished):
                    event.stats.ttft_s += restore.seconds  # the user waited for the restore too
                    event.stats.extra.update(restore.to_stats())
                    event.stats.extra["conversation_id"] = conversation_id
                    event.stats.extra["message_id"] = reply.id
                    state = "cancelled" if event.stats.finish_reason == "cancelled" else "complete"
                    writer.finish(state, event.stats.to_dict(), event.text)
                    self._learn_prefill_rate(event)
                yield event
        except BaseException:
            writer.finish("failed")
            self._in_memory = None
            self.session.reset()
            raise
        yield self.save(conversation_id)

    def save(self, conversation_id: int) -> CacheSaved:
        """Write the cache's new chunks; a failure here costs speed later, never text."""
        try:
            report = self.kvstore.save(conversation_id, self.session.tokens, self.session.cache)
        except (DiskFull, OSError) as exc:
            return CacheSaved(SaveReport(), error=str(exc))
        if self.budget_bytes is not None:
            entry = self.index.conversation(conversation_id)
            keep = set(entry.chunk_keys) if entry else set()
            self.index.evict_to_budget(self.budget_bytes, keep)
        return CacheSaved(report)

    # -- where the cache comes from ---------------------------------------------

    def _prepare_cache(
        self, conversation_id: int, render: Callable[[Sequence[int]], list[int]], kv: KVSettings
    ) -> RestoreInfo:
        """Leave in `session` the best cache for this turn, and say where it came from."""
        if self._in_memory == conversation_id and self.session.cache is not None:
            return RestoreInfo(source="memory", tokens=len(self.session.tokens))
        self.session.reset()
        self._in_memory = conversation_id
        entry = self.index.conversation(conversation_id)
        if entry is None:
            return RestoreInfo(rejected="no saved cache")
        prompt = render(entry.tokens)
        usable, size = self.kvstore.plan(entry, prompt)
        if entry.kv_format != SNAPSHOT and not usable_format(
            entry.kv_format, scheme_for(kv.bits, kv.group_size)
        ):
            return RestoreInfo(
                rejected=f"saved as {entry.kv_format}, which the current KV "
                f"setting ({kv.describe()}) cannot use"
            )
        info = RestoreInfo()
        bandwidth = self.measurements.get(READ_BANDWIDTH)
        rate = self.measurements.get(self._prefill_key())
        info.estimate_restore_s = size / bandwidth if bandwidth else None
        info.estimate_recompute_s = usable / rate if rate else None
        if (
            info.estimate_restore_s is not None
            and info.estimate_recompute_s is not None
            and info.estimate_recompute_s < info.estimate_restore_s
        ):
            info.rejected = "recomputing is estimated to be faster than reading"
            return info
        result = self.kvstore.restore(entry, prompt)
        info.seconds, info.bytes_read = result.seconds, result.bytes_read
        if result.cache is None:
            info.rejected = result.rejected
            return info
        self.session.cache, self.session.tokens = result.cache, result.tokens
        info.source, info.tokens = "disk", len(result.tokens)
        if result.bytes_read and result.seconds > 0:
            self.measurements.observe(READ_BANDWIDTH, result.bytes_read / result.seconds)
        return info

    def _prefill_key(self) -> str:
        return f"prefill_tps:{self.kvstore.fingerprint}"

    def _learn_prefill_rate(self, finished: TurnFinished) -> None:
        if finished.stats.prefilled_tokens >= _MEASURE_MIN_TOKENS and finished.stats.prefill_tps:
            self.measurements.observe(self._prefill_key(), finished.stats.prefill_tps)
