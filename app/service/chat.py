"""`ChatService`: every use case and every write, in one place (docs/architecture.md §1–2).

The window and the terminal both drive a `ChatService`; in the window it lives
on the worker's thread, so its calls run one after another: a save and a
garbage collection can never interleave. Across processes, a turn holds the
conversation's writer lock (`sessions.locks`), and garbage collection leaves
alone the files too young to have their index row yet.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import sqlite_utils

from app.engine import loading, models
from app.engine.conversation import ConversationEngine
from app.engine.turns import RestoreInfo, TurnEvent, TurnOptions
from app.service.preferences import Preferences
from sessions import paths
from sessions.cachefiles import CacheIndex
from sessions.conversations import Conversation, ConversationStore
from sessions.locks import conversation_lock
from sessions.overrides import ChatOverrides
from sessions.repair import on_start as repair_on_start
from sessions.settings import Settings

ShouldStop = Callable[[], bool]


@dataclass(frozen=True)
class ContextUse:
    """A chat's size in tokens, with the draft message, against the context it has."""

    conversation_id: int | None
    draft_text: str  # what was counted, so the window knows whether it is still current
    conversation: int  # tokens of the chat as the model reads it (with the system prompt)
    draft: int  # what the draft message adds
    limit: int  # the model's context, or the preference's smaller maximum
    before: int | None = None  # counted only the messages before this one (an edit)

    @property
    def fits(self) -> bool:
        """Whether the chat with the draft leaves room for at least one token of reply."""
        return self.conversation + self.draft < self.limit


def never() -> bool:
    return False


class ChatService:
    def __init__(self, db: sqlite_utils.Database, models_dir: Path | None = None) -> None:
        self.db = db
        self.store = ConversationStore(db)
        self.index = CacheIndex(db)
        self.settings = Settings(db)
        self.models_dir = models_dir or paths.models_dir()
        self.engine: ConversationEngine | None = None

    def repair(self) -> dict[str, int]:
        """Put right what a killed process left (see `sessions.repair`); once at start."""
        return repair_on_start(self.db)

    # -- preferences and the model ------------------------------------------------

    def preferences(self) -> Preferences:
        return Preferences.load(self.settings)

    def save_preferences(self, prefs: Preferences) -> None:
        prefs.save(self.settings)

    def load_model(self, name: str | None = None) -> ConversationEngine:
        """The engine for model `name` (None: the preferred one), loading it only if
        it is not the one loaded. The one engine factory."""
        prefs = self.preferences()
        path = models.resolve(name or prefs.model, self.models_dir)
        if self.engine is None or self.engine.loaded.path != path:
            self.engine = None  # free the old model's memory before loading the new
            self.engine = ConversationEngine(
                self.db,
                loading.load(path),
                chunk_tokens=prefs.cache_chunk_tokens,
                budget_bytes=prefs.cache_budget_bytes,
            )
        return self.engine

    def _engine(self) -> ConversationEngine:
        return self.engine if self.engine is not None else self.load_model()

    # -- turns -------------------------------------------------------------------------

    def send(
        self,
        conversation_id: int,
        text: str,
        prefs: Preferences | None = None,
        should_stop: ShouldStop = never,
    ) -> Iterator[TurnEvent]:
        return self._locked(
            conversation_id, prefs, lambda e, o: e.send(conversation_id, text, o, should_stop)
        )

    def regenerate(
        self,
        conversation_id: int,
        prefs: Preferences | None = None,
        should_stop: ShouldStop = never,
    ) -> Iterator[TurnEvent]:
        return self._locked(
            conversation_id, prefs, lambda e, o: e.regenerate(conversation_id, o, should_stop)
        )

    def edit(
        self,
        message_id: int,
        text: str,
        prefs: Preferences | None = None,
        should_stop: ShouldStop = never,
    ) -> Iterator[TurnEvent]:
        conversation_id = self.store.message(message_id).conversation_id
        return self._locked(
            conversation_id, prefs, lambda e, o: e.edit(message_id, text, o, should_stop)
        )

    def _locked(
        self,
        conversation_id: int,
        prefs: Preferences | None,
        turn: Callable[[ConversationEngine, TurnOptions], Iterator[TurnEvent]],
    ) -> Iterator[TurnEvent]:
        """A turn under the conversation's writer lock, with `prefs` or the saved ones
        and the chat's own settings on them."""
        options = self.chat_preferences(conversation_id, prefs).turn_options()
        with conversation_lock(conversation_id):
            engine = self._engine()
            self._record_model(conversation_id, engine)
            yield from turn(engine, options)

    def continue_reply(
        self,
        message_id: int,
        prefs: Preferences | None = None,
        should_stop: ShouldStop = never,
    ) -> Iterator[TurnEvent]:
        """More of a reply cut by the length limit, stopped or interrupted, in place."""
        conversation_id = self.store.message(message_id).conversation_id
        return self._locked(
            conversation_id, prefs, lambda e, o: e.continue_reply(message_id, o, should_stop)
        )

    def chat_preferences(
        self, conversation_id: int, prefs: Preferences | None = None
    ) -> Preferences:
        """What a turn of this chat runs with: `prefs` (or the saved ones) with the
        chat's own settings applied by the one rule, `Preferences.for_chat`."""
        base = prefs or self.preferences()
        return base.for_chat(self.store.get(conversation_id).overrides)

    def _record_model(self, conversation_id: int, engine: ConversationEngine) -> None:
        """A chat continued with another model is now that model's chat."""
        if self.store.get(conversation_id).model != engine.loaded.name:
            self.set_chat_model(conversation_id, engine.loaded.name)

    def prefetch(self, conversation_id: int, prefs: Preferences | None = None) -> RestoreInfo:
        """Restore the conversation's saved cache into memory before its next turn is
        asked for (the window does this when a conversation is selected)."""
        kv = self.chat_preferences(conversation_id, prefs).turn_options().kv
        return self._engine().prefetch(conversation_id, kv)

    def context_use(
        self, conversation_id: int | None, draft: str, before: int | None = None
    ) -> ContextUse:
        """Count the chat (None: a new one) and the draft with the model's tokenizer.
        With `before` (a message being edited, or a reply being made again), the chat
        counts only the messages before it: the draft takes its place."""
        engine = self._engine()
        prefs = self.preferences()
        chat, system = [], prefs.system_prompt or None
        if conversation_id is not None:
            conversation = self.store.get(conversation_id)
            leaf = conversation.current_message_id
            if before is not None:
                leaf = self.store.message(before).parent_id
            chat = [{"role": m.role, "content": m.content} for m in self.store.branch(leaf)]
            system = conversation.system_for(system)
        counted = len(engine.session.render(chat, system)) if chat or system else 0
        with_draft = counted
        if draft.strip():
            with_draft = len(
                engine.session.render([*chat, {"role": "user", "content": draft}], system)
            )
        own = engine.loaded.context_length
        limit = min(own, prefs.max_context or own)
        return ContextUse(conversation_id, draft, counted, with_draft - counted, limit, before)

    # -- conversations -------------------------------------------------------------

    def create_conversation(
        self,
        model: str,
        system_prompt: str | None = None,
        overrides: ChatOverrides | None = None,
    ) -> Conversation:
        chat = self.store.create(model, system_prompt)
        if overrides is not None and overrides.given():
            self.set_chat_settings(chat.id, overrides)
            chat = self.store.get(chat.id)
        return chat

    def rename(self, conversation_id: int, title: str) -> None:
        self.store.rename(conversation_id, title.strip())

    def set_system_prompt(self, conversation_id: int, text: str) -> None:
        """This chat's own system prompt; empty: the default from the preferences.
        A saved cache that began with the old prompt is then no longer a prefix, so
        the next turn recomputes (the cache rule, not a special case)."""
        self.store.update_settings(conversation_id, system_prompt=text.strip() or None)

    def set_chat_settings(self, conversation_id: int, overrides: ChatOverrides) -> None:
        """This chat's own sampling and KV settings (None each: the default); refused
        with `InvalidPreference` when one is not a value the preferences accept.
        A new KV setting leaves the saved cache as it is: its format is part of its
        key, so the next turn restores it where the new setting can use it, and
        otherwise recomputes and saves the new format beside it."""
        self.store.set_overrides(conversation_id, self.preferences().check_chat(overrides))

    def set_chat_model(self, conversation_id: int, name: str) -> None:
        """The model this chat goes on with (it offers that one when reopened)."""
        self.store.update_settings(conversation_id, model=name)

    def select_branch(self, conversation_id: int, message_id: int) -> None:
        self.store.select_branch(conversation_id, message_id)

    def delete(self, conversation_id: int) -> None:
        """The conversation, its messages, the cache files only it used, and its lock file."""
        with conversation_lock(conversation_id) as lock:
            entry = self.index.conversation(conversation_id)
            self.store.delete(conversation_id)
            if self.engine is not None:
                self.engine.forget(conversation_id)
            if entry is not None:  # now, not at the next gc: they are known to be its own
                self.index.release(set(entry.all_keys))
            self.index.collect_garbage()
            lock.discard()

    # -- caches -----------------------------------------------------------------------

    def clear_caches(self) -> None:
        """Every KV cache file; the text stays, and a chat's next turn recomputes
        (the one chat whose cache is in memory keeps it, and saves it again)."""
        self.index.clear()

    def collect_garbage(self) -> dict[str, int]:
        return self.index.collect_garbage()

    def export_cache(self, conversation_id: int, out: Path):
        """Write the conversation's KV cache as an mlx-lm prompt cache file."""
        from app.engine.export import export_cache

        conversation = self.store.get(conversation_id)
        engine = self.load_model(conversation.model)
        return export_cache(engine.kvstore, conversation_id, out, conversation.model)

    def export_text(self, conversation_id: int, fmt: str, out: Path) -> Path:
        from sessions.errors import storage_errors

        text = self.store.export(conversation_id, fmt)
        with storage_errors(out):
            out.write_text(text, encoding="utf-8")
        return out
