"""Turns in stored conversations: messages in SQLite, the KV cache on disk.

`ConversationEngine` is what the terminal and the GUI worker drive. For each
turn it commits the user's message, decides where the KV cache comes from
(`memory` when this process just ran the conversation, `disk` when the
planner says restoring beats recomputing and the files pass every check,
`recompute` otherwise), streams the reply into the database, and after the
reply is complete saves the cache's new chunks.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Callable, Iterator
from dataclasses import replace

import sqlite_utils

from app.engine.cache_keys import SNAPSHOT
from app.engine.chat import ChatSession, Event
from app.engine.generation import (
    KVSettings,
    TextDelta,
    TurnFinished,
)
from app.engine.kvscheme import usable_format
from app.engine.kvstore import KVStore, SaveReport
from app.engine.loading import LoadedModel
from app.engine.planner import ReopenPlanner, recompute_is_faster
from app.engine.prompt_checkpoints import PromptCheckpoints
from app.engine.restore_race import Races
from app.engine.snapshots import can_trim
from app.engine.steps import reusable_prefix
from app.engine.turns import (
    CacheSaved,
    NotAReply,
    ReplyFinished,
    RestoreInfo,
    TurnEvent,
    TurnOptions,
)
from sessions.cachefiles import CacheIndex, ConversationCache, DiskFull
from sessions.conversations import ConversationStore, ReplyWriter
from sessions.measurements import Measurements

_NOTHING = ("recompute", 0.0, 0, 0)  # source, seconds, bytes and tokens of no restore


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
        self.planner = ReopenPlanner(Measurements(db), self.kvstore)
        self.session = ChatSession(loaded)
        self.loaded = loaded
        self.budget_bytes = budget_bytes
        self._in_memory: int | None = None  # the conversation whose cache `session` holds
        self._unstamped: list[str] = []  # files this turn restored from, for its save to stamp
        self.races = Races(self.kvstore, self.planner)  # restores beside recomputing
        # Checkpoints before generation prompts, for the chats that need them.
        self.prompt_checkpoints = PromptCheckpoints(self.kvstore, self.session)

    # -- the three ways to get a reply ----------------------------------------

    def send(
        self,
        conversation_id: int,
        text: str,
        options: TurnOptions,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> Iterator[TurnEvent]:
        parent = self.store.get(conversation_id).current_message_id
        yield from self._turn(conversation_id, parent, text, options, should_stop)

    def regenerate(
        self,
        conversation_id: int,
        options: TurnOptions,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> Iterator[TurnEvent]:
        """A new sibling of the last reply (the old one stays, as another branch)."""
        messages = self.store.get(conversation_id).messages
        if not messages:
            return
        last = messages[-1]
        parent = last.parent_id if last.role == "assistant" else last.id
        yield from self._turn(conversation_id, parent, None, options, should_stop)

    def edit(
        self,
        message_id: int,
        text: str,
        options: TurnOptions,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> Iterator[TurnEvent]:
        """A new sibling of a user message with `text`, and a reply to it."""
        original = self.store.message(message_id)
        yield from self._turn(
            original.conversation_id, original.parent_id, text, options, should_stop
        )

    def continue_reply(
        self,
        message_id: int,
        options: TurnOptions,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> Iterator[TurnEvent]:
        """Go on with an assistant reply that stopped early (the length limit, Stop, a
        killed process): the model reads the conversation and the reply so far, and the
        new text is appended to the same message."""
        reply = self.store.message(message_id)
        if reply.role != "assistant":
            raise NotAReply("Only a reply can be continued")
        conversation_id = reply.conversation_id
        chat, system = self._chat(conversation_id, reply.parent_id, options)

        def render(known: list[int]) -> list[int]:
            return self.session.render(chat, system, known, reply_so_far=reply.content)

        prompt, entry = self._fitting_prompt(conversation_id, render, options)
        self.store.update_settings(conversation_id, current_message_id=message_id)
        prompt, restore = self._cache_for(conversation_id, entry, prompt, render, options)
        yield restore
        self.store.update_message(message_id, state="streaming")
        writer = ReplyWriter(self.store, message_id)
        writer.text = reply.content
        yield from self._stream(writer, conversation_id, prompt, restore, options, should_stop)
        yield self.save(conversation_id)

    # -- one turn --------------------------------------------------------------

    def _turn(
        self,
        conversation_id: int,
        parent_id: int | None,
        user_text: str | None,
        options: TurnOptions,
        should_stop: Callable[[], bool],
    ) -> Iterator[TurnEvent]:
        """Reply after `parent_id`, with a new user message first when `user_text` is
        given. The prompt is checked against the context before anything is stored,
        so a message too long for the model leaves the conversation as it was."""
        chat, system = self._chat(conversation_id, parent_id, options)
        if user_text is not None:
            chat.append({"role": "user", "content": user_text})

        def render(known: list[int]) -> list[int]:
            return self.session.render(chat, system, known)

        prompt, entry = self._fitting_prompt(conversation_id, render, options)
        if user_text is not None:
            parent_id = self.store.add_message(
                conversation_id, "user", user_text, parent_id=parent_id
            ).id
        self.store.update_settings(conversation_id, current_message_id=parent_id)
        prompt, restore = self._cache_for(conversation_id, entry, prompt, render, options)
        yield restore
        reply = self.store.add_message(
            conversation_id, "assistant", "", parent_id=parent_id, state="streaming"
        )
        writer = ReplyWriter(self.store, reply.id)
        yield from self._stream(writer, conversation_id, prompt, restore, options, should_stop)
        yield self.save(conversation_id)

    def _chat(
        self, conversation_id: int, parent_id: int | None, options: TurnOptions
    ) -> tuple[list[dict], str | None]:
        """The branch ending at `parent_id` as chat messages, and the system prompt."""
        conversation = self.store.get(conversation_id)
        chat = [{"role": m.role, "content": m.content} for m in self.store.branch(parent_id)]
        system = conversation.system_for(options.system)
        return chat, system

    def _fitting_prompt(
        self,
        conversation_id: int,
        render: Callable[[list[int]], list[int]],
        options: TurnOptions,
    ) -> tuple[list[int], ConversationCache | None]:
        """The prompt, keeping the tokens of the cache this turn can start from (the one
        in memory, else the saved one), and the saved cache's entry; raises when the
        prompt does not fit the context."""
        held = self._holds(conversation_id)
        entry = None if held else self.index.conversation(conversation_id)
        known = self.session.tokens if held else entry.tokens if entry else []
        prompt = render(known)
        self.session.check_fits(len(prompt), options.max_context)
        return prompt, entry

    def _cache_for(
        self,
        conversation_id: int,
        entry: ConversationCache | None,
        prompt: list[int],
        render: Callable[[list[int]], list[int]],
        options: TurnOptions,
    ) -> tuple[list[int], RestoreInfo]:
        restore = self._prepare_cache(conversation_id, entry, prompt, options.kv)
        if restore.source == "recompute" and entry is not None and not restore.raced:
            # The saved tokens go with the cache they came from: without it, the
            # turn is what it would be had nothing been saved.
            prompt = render([])
        return prompt, replace(restore, prompt_tokens=len(prompt))

    def _stream(
        self,
        writer: ReplyWriter,
        conversation_id: int,
        prompt: list[int],
        restore: RestoreInfo,
        options: TurnOptions,
        should_stop: Callable[[], bool],
    ) -> Iterator[Event | ReplyFinished]:
        """Stream the reply into `writer`'s message, after the text it already has."""
        before = writer.text
        lead = ""  # a fresh detokenizer drops a continuation's leading space; put it back
        first = True
        try:
            for event in self.session.generate(
                prompt,
                sampling=options.sampling,
                kv=options.kv,
                should_stop=should_stop,
                max_context=options.max_context,
                checkpoint=self.prompt_checkpoints.for_turn(conversation_id, prompt),
                race=self.races.current,
            ):
                if isinstance(event, TextDelta):
                    if first and before:
                        lead = self._dropped_space(prompt, event.text)
                        event = TextDelta(lead + event.text)
                    first = False
                    writer.append(event.text)
                elif isinstance(event, TurnFinished):
                    restore = self._end_race(restore)
                    text = before + lead + event.text
                    event = ReplyFinished(
                        text, event.stats, restore, conversation_id, writer.message_id
                    )
                    state = "cancelled" if event.stats.finish_reason == "cancelled" else "complete"
                    writer.finish(state, event.to_dict(), text)
                    if state == "complete" and not (restore.raced and restore.source == "disk"):
                        # (a stopped turn's prefill, or one let go, counts tokens not fed)
                        self.planner.learn_prefill_rate(event.stats)
                yield event
        except BaseException:
            self._end_race(restore)
            writer.finish("failed")
            self._in_memory = None
            self.session.reset()
            self._stamp_restored()
            raise

    def _dropped_space(self, prompt: list[int], first_text: str) -> str:
        """ " " when the first new token begins with a space its streamed text lost."""
        generated = self.session.tokens[len(prompt) : len(prompt) + 1]
        spelled = self.loaded.tokenizer.decode(generated) if generated else ""
        return " " if spelled.startswith(" ") and not first_text.startswith(" ") else ""

    def save(self, conversation_id: int) -> CacheSaved:
        """Write the cache's new chunks; a failure here costs speed later, never text."""
        taken = self.prompt_checkpoints.for_save(conversation_id)
        try:
            report = self.kvstore.save(
                conversation_id, self.session.tokens, self.session.cache, taken
            )
        except (DiskFull, OSError) as exc:
            self._stamp_restored()
            return CacheSaved(SaveReport(), error=str(exc))
        self._unstamped = []  # the save stamped every file of the chat
        if self.budget_bytes is not None:
            entry = self.index.conversation(conversation_id)
            keep = set(entry.all_keys) if entry else set()
            self.index.evict_to_budget(self.budget_bytes, keep)
        return CacheSaved(report)

    def forget(self, conversation_id: int) -> None:
        """Drop the in-memory cache of a conversation that is gone."""
        if self._in_memory == conversation_id:
            self._in_memory = None
            self.session.reset()

    # -- where the cache comes from ---------------------------------------------

    def _holds(self, conversation_id: int) -> bool:
        return self._in_memory == conversation_id and self.session.cache is not None

    def _prepare_cache(
        self,
        conversation_id: int,
        entry: ConversationCache | None,
        prompt: list[int],
        kv: KVSettings,
    ) -> RestoreInfo:
        """Leave in `session` the best cache for this turn, and say where it came from.
        A cache in memory of another KV setting's format is not used (nor, below, one
        saved so): the turn reads the conversation again, and says so."""
        if self._holds(conversation_id):
            held = self.session.tokens
            usable = reusable_prefix(held, prompt)
            if self.session.cache_usable(kv):
                if usable == len(held) or can_trim(self.session.cache):
                    # What this turn keeps: a regenerate or an edit cuts the cache back.
                    return RestoreInfo(source="memory", tokens=usable, held_tokens=len(held))
                if self.prompt_checkpoints.resume(conversation_id, usable):
                    kept = len(self.session.tokens)
                    return RestoreInfo(source="memory", tokens=kept, held_tokens=len(held))
            # An edit or a regenerate before the end of a cache that cannot be cut
            # back (resume from the checkpoint on disk before the change), or a cache
            # of another KV setting's format.
            entry = self.index.conversation(conversation_id)
        refused = self._drop_and_check(conversation_id, entry, kv)
        if refused is not None:
            return refused
        usable = reusable_prefix(entry.tokens, prompt)
        estimates = self.planner.estimates(entry, usable, len(prompt))
        if self.races.wanted(usable, len(prompt)) and self.races.start(entry, usable):
            return RestoreInfo(*_NOTHING, *estimates, raced=True)
        if recompute_is_faster(estimates):
            return RestoreInfo(*_NOTHING, *estimates, "recomputing is estimated to be faster")
        restored = self._restore(entry, usable, estimates)
        if restored.source == "disk":
            self._unstamped = list(entry.all_keys)  # after the reply: see `_stamp_restored`
        return restored

    def prefetch(self, conversation_id: int, kv: KVSettings) -> RestoreInfo:
        """Restore a conversation's whole saved cache now, while the user reads and
        types, so that its next turn starts from memory as if it had never closed.
        No planner: the time is the user's, not the reply's. (The next turn trims what
        its prompt does not share, or goes back to disk for a cache that cannot be cut.)
        Where the next turn will go on from before the last generation prompt rather than
        from the end (`PromptCheckpoints.next_turn_start`), the restore stops there."""
        if self._holds(conversation_id):
            return RestoreInfo(source="memory", tokens=len(self.session.tokens))
        entry = self.index.conversation(conversation_id)
        refused = self._drop_and_check(conversation_id, entry, kv)
        if refused is not None:
            return refused
        usable = self.prompt_checkpoints.next_turn_start(entry) or len(entry.tokens)
        restored = self._restore(entry, usable, (None, None))
        if restored.source == "disk":
            # Used: eviction keeps it over chats not opened since (a turn's save stamps
            # its files too, after the reply; `KVStore.restore` leaves them unstamped).
            self.index.touch(entry.all_keys)
        return restored

    def _stamp_restored(self) -> None:
        """Stamp as used the files this turn restored from, where its save did not (it
        failed, or the turn did): eviction goes by use. Not at the restore: a write
        there (an SQLite commit) would delay the first token, and a turn's save stamps
        every file of the chat anyway. A database that cannot be written costs only
        the order of eviction."""
        keys, self._unstamped = self._unstamped, []
        if keys:
            with contextlib.suppress(sqlite3.Error):
                self.index.touch(keys)

    def _drop_and_check(
        self, conversation_id: int, entry: ConversationCache | None, kv: KVSettings
    ) -> RestoreInfo | None:
        """Let go of the cache in memory (`conversation_id` is the one coming); then why
        its saved cache cannot serve a turn with `kv`, if it cannot."""
        self._end_race(RestoreInfo())
        self.session.reset()
        self._in_memory = conversation_id
        if entry is None:
            return RestoreInfo(rejected="no saved cache")
        if entry.kv_format != SNAPSHOT and not usable_format(
            entry.kv_format, self.session.kv_scheme(kv)
        ):
            return RestoreInfo(
                rejected=f"saved as {entry.kv_format}, which the current KV "
                f"setting ({kv.describe()}) cannot use"
            )
        return None

    def _end_race(self, restore: RestoreInfo) -> RestoreInfo:
        """`restore` as the turn's race ended, if it raced."""
        restore = self.races.end(restore)
        if restore.raced and restore.source == "disk":
            self._unstamped = self.races.keys  # after the reply: see `_stamp_restored`
        return restore

    def _restore(
        self,
        entry: ConversationCache,
        usable: int,
        estimates: tuple[float | None, float | None],
    ) -> RestoreInfo:
        """Read `usable` tokens of `entry` from disk into `session`."""
        result = self.kvstore.restore(entry, usable)
        if result.cache is None:
            return RestoreInfo("recompute", result.seconds, 0, 0, *estimates, result.rejected)
        self.session.cache, self.session.tokens = result.cache, result.tokens
        self.planner.learn_read(result.bytes_read, result.seconds)
        self.planner.learn_copy(result.bytes_read, result.copy_s)  # for races, on a GPU
        return RestoreInfo(
            "disk",
            result.seconds,
            result.bytes_read,
            len(result.tokens),
            *estimates,
            checkpoint=result.checkpoint,
        )
