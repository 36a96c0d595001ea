"""The main window: it wires the sidebar, chat view, composer and status bar to
the worker. It reads the database on its own read-only connection and asks the
worker (which owns the `ChatService`, the one writer) for every change."""

from __future__ import annotations

from typing import TYPE_CHECKING

from PySide6.QtCore import Qt, QTimer, Signal, Slot
from PySide6.QtWidgets import (
    QMainWindow,
    QMessageBox,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from app import __version__
from app.service.preferences import Preferences
from app.ui import quitting, theme, window_place
from app.ui.chat_actions import ChatActions
from app.ui.chat_header import ChatHeader
from app.ui.chat_setup import ChatSetup
from app.ui.chat_view import ChatView
from app.ui.composer import Composer
from app.ui.context_meter import ContextMeter
from app.ui.draft_keeper import DraftKeeper
from app.ui.menus import build_menus
from app.ui.model_bar import ModelBar
from app.ui.model_flow import ModelFlow
from app.ui.preferences import kv_label
from app.ui.reading import rendered_messages, sidebar_entries
from app.ui.sidebar import Sidebar
from app.ui.turn_flow import TurnFlow
from app.ui.turn_status import TurnStatus
from app.worker import NEW_CONVERSATION, WorkerThread
from sessions.cachefiles import CacheIndex
from sessions.conversations import ConversationStore
from sessions.db import open_db
from sessions.settings import Settings

if TYPE_CHECKING:  # the engine is imported on the worker's thread, after the first paint
    from app.engine.turns import CacheSaved, ReplyFinished, RestoreInfo
    from app.service.chat import ContextUse


COUNT_AFTER_MS = 300
# Enter pressed while a reply is written: why nothing was sent (a new-user walk).
HELD = "A reply is being written: your message waits here until it ends (Esc stops it)"
HELD_BY_ADD = (
    "A model is being added: your message waits here until that ends (Esc cancels a download)"
)


class MainWindow(QMainWindow):
    # Requests to the worker thread (queued: the worker lives on its own thread).
    load_model_requested = Signal(str)
    send_requested = Signal(int, str)
    regenerate_requested = Signal(int)
    edit_requested = Signal(int, str)
    continue_requested = Signal(int)  # an assistant message
    context_requested = Signal(int, str, int)  # conversation (NEW_CONVERSATION: none), draft,
    # and the message the draft replaces (an edit; 0: none)
    rename_requested = Signal(int, str)
    delete_requested = Signal(int)
    branch_requested = Signal(int, int)  # conversation, message
    clear_caches_requested = Signal()
    export_requested = Signal(int, str, str)  # conversation, format, path
    save_preferences_requested = Signal(object)  # Preferences
    prefetch_requested = Signal(int)  # a conversation just selected
    system_prompt_requested = Signal(int, str)  # conversation, its own prompt ("": default)
    chat_settings_requested = Signal(int, object)  # conversation, its ChatOverrides
    chat_model_requested = Signal(int, str)  # conversation, the model it now goes on with

    def __init__(self) -> None:
        super().__init__()
        self.setWindowTitle(f"Reprise {__version__}")
        self.resize(1100, 720)
        # Smaller, the chat header wrapped onto five clipped lines over a chat 50 px tall.
        self.setMinimumSize(640, 480)
        self.db = open_db(read_only=True)
        self.store = ConversationStore(self.db)
        self.index = CacheIndex(self.db)
        self.conversation_id: int | None = None
        self._asked: Preferences | None = None  # asked to be saved, not saved yet
        self.generating = False
        self._boxes_up: set[str] = set()  # the failures a box on screen says
        self._turn_asked = False  # a turn was asked for, until it ends
        self._adding = False  # the worker is adding a model
        self.closing = False  # Quit: waiting for the worker to stop
        self.library_open = False  # the Models dialog is up (menus.open_models)

        self.sidebar = Sidebar()
        self.header = ChatHeader()
        self.chat = ChatView()
        self.composer = Composer()
        self.chat.type_into = self.sidebar.list.type_into = self.composer.edit
        self.drafts = DraftKeeper(self.composer, self)
        self.meter = ContextMeter()
        # Count the draft once typing pauses, not at every key.
        self._count_soon = QTimer(self, singleShot=True, interval=COUNT_AFTER_MS)
        self.models = ModelBar()
        self._build_layout()
        left = window_place.restore(self)  # where it was, and the chat it showed
        theme.follow(self.chat, self.preferences().theme)
        self.status = TurnStatus(self.statusBar())
        self.turns = TurnFlow(self)
        self.setup = ChatSetup(self)
        self.model_flow = ModelFlow(self)
        self.actions = ChatActions(self)
        build_menus(self)

        self.engine = WorkerThread()
        self._wire()
        self.model_flow.refresh()
        self.refresh_sidebar()
        chats = self.store.list()  # the most recently used first
        self.drafts.prune({chat.id for chat in chats})
        self.show_conversation(window_place.chat_left_open(left, [c.id for c in chats]))
        self.composer.edit.setFocus()  # open ready to type
        self.model_flow.load_chosen()

    def preferences(self) -> Preferences:
        """The preferences as the user last set them: the ones asked for and not yet
        saved by the worker, or else the saved ones."""
        return self._asked or Preferences.load(Settings(self.db))

    def ask_to_save(self, prefs: Preferences) -> None:
        """Each request builds on the one before, even before the worker has saved it."""
        self._asked = prefs
        self.save_preferences_requested.emit(prefs)

    @Slot(object)
    def on_preferences_saved(self, prefs: Preferences) -> None:
        if prefs is self._asked:
            self._asked = None
        self._show_header()  # the default system prompt may have changed
        theme.choose(prefs.theme)

    # -- layout and wiring -----------------------------------------------------

    def _build_layout(self) -> None:
        right = QWidget()
        column = QVBoxLayout(right)
        column.addWidget(self.header)
        column.addWidget(self.chat, 1)
        column.addWidget(self.composer)
        column.addWidget(self.meter)
        self.splitter = QSplitter()
        self.splitter.addWidget(self.sidebar)
        self.splitter.addWidget(right)
        # Both give way as the window narrows, the chat three times as much (a new-user
        # walk: at 640 px the sidebar kept 250 and the chat's header wrapped four times).
        self.splitter.setStretchFactor(0, 1)
        self.splitter.setStretchFactor(1, 3)
        self.splitter.setSizes([260, 840])
        self.setCentralWidget(self.splitter)
        self.addToolBar(self.models)

    def _wire(self) -> None:
        """Every connection to and from the worker, in one place. Each handler of a
        worker signal is a slot of an object on this (the GUI) thread, so Qt queues
        the call here: widgets are only ever touched on the GUI thread."""
        worker = self.engine.worker
        for request, slot in (
            (self.load_model_requested, worker.load_model),
            (self.send_requested, worker.send),
            (self.regenerate_requested, worker.regenerate),
            (self.edit_requested, worker.edit),
            (self.continue_requested, worker.continue_reply),
            (self.context_requested, worker.count_context),
            (self.rename_requested, worker.rename),
            (self.delete_requested, worker.delete),
            (self.branch_requested, worker.select_branch),
            (self.clear_caches_requested, worker.clear_caches),
            (self.export_requested, worker.export_text),
            (self.save_preferences_requested, worker.save_preferences),
            (self.prefetch_requested, worker.prefetch),
            (self.system_prompt_requested, worker.set_system_prompt),
            (self.chat_settings_requested, worker.set_chat_settings),
            (self.chat_model_requested, worker.set_chat_model),
        ):
            request.connect(slot)
        worker.model_loaded.connect(self.model_flow.on_loaded)
        worker.preferences_saved.connect(self.on_preferences_saved)
        worker.conversation_started.connect(self.on_conversation_started)
        worker.restored.connect(self.on_restored)
        worker.text_delta.connect(self.chat.add_text)
        worker.text_delta.connect(self.status.on_first_text)
        worker.text_delta.connect(self.status.on_text)
        worker.text_delta.connect(self.meter.on_text)
        worker.prompt_progress.connect(self.status.on_prompt_progress)
        worker.finished.connect(self.on_finished)
        worker.saved.connect(self.on_saved)
        worker.changed.connect(self.on_changed)
        worker.failed.connect(self.on_failed)
        worker.turn_failed.connect(self.on_turn_failed)
        worker.exported.connect(self.status.on_exported)
        worker.busy_changed.connect(self.on_busy)
        worker.adding_changed.connect(self.on_adding)
        worker.context_counted.connect(self.on_context_counted)
        worker.prefetched.connect(self.on_prefetched)
        worker.model_added.connect(self.model_flow.on_added)
        worker.import_progress.connect(self.model_flow.on_import_progress)
        worker.download_progress.connect(self.model_flow.on_download_progress)
        self.composer.edit.textChanged.connect(self._count_soon.start)
        self._count_soon.timeout.connect(self.ask_context)
        self.meter.new_chat_requested.connect(self.turns.send_in_new_chat)
        self.composer.send_requested.connect(self.drafts.forget)
        self.composer.send_requested.connect(self.turns.send)
        self.composer.send_held.connect(
            lambda: self.status.say_while_busy(HELD if self.replying else HELD_BY_ADD)
        )
        self.composer.edit_requested.connect(self.turns.edit_sent)
        self.composer.editing_changed.connect(self.chat.mark_editing)
        # Direct, not queued: the worker thread is busy generating; this only sets a flag.
        self.composer.stop_requested.connect(worker.stop, Qt.ConnectionType.DirectConnection)
        self.chat.action.connect(self.turns.on_chat_action)
        self.header.system_prompt_requested.connect(self.setup.change_system_prompt)
        self.header.settings_requested.connect(self.setup.change_chat_settings)
        self.header.switch_requested.connect(self.model_flow.pick)
        self.header.keep_requested.connect(self.keep_chat_model)
        self.sidebar.new_requested.connect(self.new_chat)
        self.sidebar.conversation_selected.connect(self.show_conversation)
        self.sidebar.clicked.connect(self.composer.edit.setFocus)  # ready to type, as a new chat
        self.sidebar.match_opened.connect(self.show_match)
        self.sidebar.search_changed.connect(self.refresh_sidebar)
        self.sidebar.rename_requested.connect(self.actions.rename)
        self.sidebar.delete_requested.connect(self.actions.delete)
        self.sidebar.export_requested.connect(self.actions.export)
        self.models.picked.connect(self.model_flow.pick)

    def model_ready(self) -> None:
        """The model picked is in: the header, the meter and the chat's cache follow."""
        self._show_header()
        self.ask_context()
        if not self.generating:  # a turn that loaded the model has its cache
            self._prefetch(self.conversation_id)

    # -- conversations -----------------------------------------------------------

    @Slot()
    @Slot(str)
    def refresh_sidebar(self, *_args) -> None:
        query = self.sidebar.search.text().strip()
        entries = sidebar_entries(self.store, self.index, query)
        self.sidebar.show_conversations(entries, self.conversation_id)

    @Slot()
    def new_chat(self) -> None:
        if not self.replying:
            self.show_conversation(None)
            self.composer.edit.setFocus()

    @Slot(int)
    def show_conversation(self, conversation_id: int | None) -> None:
        if self.replying:
            self._stay_while_replying()
            return
        self.setup.left()
        self.drafts.swap(conversation_id)
        self.conversation_id = conversation_id
        self.actions.after_delete = None
        self.chat.show_messages(rendered_messages(self.store, conversation_id))
        self._show_header()
        self.status.say("")
        self.status.clear_figures()
        self.sidebar.select(conversation_id)
        self.meter.clear()
        self.ask_context()
        self._prefetch(conversation_id)

    @Slot(int, int)
    def show_match(self, conversation_id: int, message_id: int) -> None:
        """A search result on a hidden branch: the chat, switched to that branch."""
        if self.replying:
            self._stay_while_replying()
            return
        self.show_conversation(conversation_id)
        self.branch_requested.emit(conversation_id, message_id)

    def _stay_while_replying(self) -> None:
        """A reply streams into the chat on screen: it stays there, and the user is
        told how to go elsewhere (the sidebar's highlight goes back to it)."""
        self.sidebar.select(self.conversation_id)
        self.status.say_while_busy("A reply is being written here: stop it (Esc) to switch chats")

    def _show_header(self) -> None:
        chat = self.store.get(self.conversation_id) if self.conversation_id else None
        models, prefs = self.models, self.preferences()
        self.header.show(chat, models.current(), prefs, models.names(), models.ready)
        mine = prefs.for_chat(chat.overrides) if chat is not None else prefs
        self.status.next_kv(kv_label(mine.kv_bits))

    @Slot(str)
    def keep_chat_model(self, name: str) -> None:
        if self.conversation_id is not None:
            self.chat_model_requested.emit(self.conversation_id, name)

    def _prefetch(self, conversation_id: int | None) -> None:
        """Start restoring the chat's saved cache now, not when the user presses Send."""
        selected = conversation_id or NEW_CONVERSATION
        self.engine.worker.select(selected)
        if selected != NEW_CONVERSATION and self.models.ready:
            self.prefetch_requested.emit(selected)

    @Slot(int, object)
    def on_prefetched(self, conversation_id: int, info: RestoreInfo) -> None:
        if conversation_id == self.conversation_id and not self.generating:
            self.status.on_prefetched(info, has_messages=bool(self.chat.messages))

    # -- the context meter ----------------------------------------------------------

    @Slot()
    def ask_context(self) -> None:
        """Ask the worker to count the chat and the draft (it has the tokenizer)."""
        if self.generating or not self.models.ready:
            return
        draft = self.composer.edit.toPlainText()
        self.count_context(draft, self.composer.editing)

    def count_context(self, draft: str, before: int | None) -> None:
        self.context_requested.emit(self.conversation_id or NEW_CONVERSATION, draft, before or 0)

    @Slot(object)
    def on_context_counted(self, use: ContextUse) -> None:
        draft, editing = self.composer.edit.toPlainText(), self.composer.editing
        self.meter.show_if_current(use, self.conversation_id, draft, editing)

    @Slot(int)
    def on_conversation_started(self, conversation_id: int) -> None:
        """A new chat was made: by the turn on screen, or for the settings chosen for a
        new chat, which the window shows only if the user is still there (a review: a
        chat opened meanwhile was taken for the new one, and its next message went there)."""
        for_settings, self.setup.making = self.setup.making, False
        if for_settings and self.conversation_id is not None:
            self.refresh_sidebar()
            return
        self.conversation_id = conversation_id
        self.drafts.started(conversation_id)
        self.refresh_sidebar()
        self._show_header()
        self.setup.made(for_settings)

    def expect_reply(self) -> None:
        """A turn was asked for: from now, not from when the worker starts it (it may be
        loading the model), the reply's chat stays on screen, and what is typed is its
        draft. The worker's `busy_changed` ends it, as every turn it runs says False.
        The message box is Stop from now too: a second Enter while the model loads sent
        a second turn, and Stop then was not heard."""
        self.generating = True
        self._turn_asked = True
        self.model_flow.turn_asked()
        self.composer.set_generating(True)
        self.engine.worker.arm()

    @property
    def replying(self) -> bool:
        """A turn was asked for and has not ended: its chat stays on screen. (The worker
        is busy with it; `generating` is also true while a model is being added.)"""
        return self._turn_asked

    @Slot(bool)
    def on_busy(self, busy: bool) -> None:
        """A turn began or ended (a review: a turn asked for during a model's add took
        that add's end for its own, and streamed under a greyed-out Send)."""
        if not busy:
            self._turn_asked = False
        self._worker_busy(busy or self._adding)
        self.status.on_busy(busy)
        self.models.show_replying(busy)
        if not busy:
            self.meter.end_reply()
            if self._gone():
                self.actions.leave_deleted_chat()  # deleted while the turn ran
            self.ask_context()  # the chat changed: count it again

    @Slot(bool)
    def on_adding(self, adding: bool) -> None:
        """A model's import, download or link began or ended."""
        self._adding = adding
        self._worker_busy(adding)
        self.status.on_busy(adding)  # what was said while it ran ends with it

    def _worker_busy(self, busy: bool) -> None:
        self.generating = busy or self._turn_asked
        self.composer.set_generating(self.replying)
        self.composer.set_waiting(self._adding and not self.replying)

    @Slot(object)
    def on_restored(self, info: RestoreInfo) -> None:
        first_turn = len(self.chat.messages) <= 2  # the question and the coming reply
        self.status.on_restored(info, first_turn)
        # The message is stored by now: a new chat's row says so while the reply is
        # written (a walk saw "New chat · no messages yet" until the reply ended).
        self.refresh_sidebar()

    @Slot(object)
    def on_finished(self, reply: ReplyFinished) -> None:
        self.turns.answered()
        if self.conversation_id == reply.conversation_id:
            self.chat.update_messages(rendered_messages(self.store, self.conversation_id))
            self._show_header()  # the turn made the model it ran with the chat's
        self.status.on_finished(reply)
        self.refresh_sidebar()
        self.ask_context()

    @Slot(object)
    def on_saved(self, saved: CacheSaved) -> None:
        self.status.on_saved(saved)
        self.refresh_sidebar()

    @Slot(int)
    def on_changed(self, conversation_id: int) -> None:
        """The worker changed something: read it again. The chat on screen deleted (during
        its reply, or by another program): `ChatActions.leave_deleted_chat`, once no turn is under
        way (the old view, left up, sent to a chat that was gone)."""
        on_screen = conversation_id in (0, self.conversation_id)
        if self._gone() and not self.generating:
            self.actions.leave_deleted_chat()
        elif on_screen and not self.generating:
            self.show_conversation(self.conversation_id)
        self.refresh_sidebar()

    def _gone(self) -> bool:
        """The chat on screen was deleted (by its delete, or by another program)."""
        return self.conversation_id is not None and not self.store.exists(self.conversation_id)

    @Slot(str)
    def on_failed(self, message: str) -> None:
        """The failure in the status bar and in a box, one box a failure (a turn behind a
        model's load that failed fails as it did: `ModelFlow.said_already`)."""
        loading = self.models.load_pending  # before `show_failed` ends it
        self.setup.failed()
        self.status.on_failed(message)
        self.models.show_failed()
        if not self.model_flow.said_already(message, loading):
            self.warn(message)

    def warn(self, message: str) -> None:
        """A warning box, unless one on screen says the same already."""
        if message in self._boxes_up:
            return
        self._boxes_up.add(message)
        try:
            QMessageBox.warning(self, "Reprise", message)
        finally:
            self._boxes_up.discard(message)

    @Slot()
    def on_turn_failed(self) -> None:
        """The chat as saved (no reply bubble waits for a reply that is not coming), and
        the turn's text back where it was written if the chat did not keep it."""
        if self.conversation_id is None or self.store.exists(self.conversation_id):
            self.chat.show_messages(rendered_messages(self.store, self.conversation_id))
        self.turns.failed()

    # -- quitting ------------------------------------------------------------------------

    def closeEvent(self, event) -> None:
        """Keep the draft and where the window is, stop a reply, let the worker finish
        its save, then go."""
        self.drafts.keep()
        window_place.keep(self)
        self.closing = True
        what = quitting.ADDING if self._adding else quitting.SAVING  # an import cannot stop
        quitting.wait_for_worker(self.engine, self, what)
        event.accept()
