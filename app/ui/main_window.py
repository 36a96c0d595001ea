"""The main window: it wires the sidebar, chat view, composer and status bar to
the worker, and to the database for what the GUI reads itself."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QElapsedTimer, Qt, QTimer, Signal
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (
    QApplication,
    QComboBox,
    QFileDialog,
    QInputDialog,
    QLabel,
    QMainWindow,
    QMessageBox,
    QProgressBar,
    QProgressDialog,
    QSplitter,
    QToolBar,
    QVBoxLayout,
    QWidget,
)

from app.engine.models import list_models
from app.ui.chat_view import ChatView
from app.ui.composer import Composer
from app.ui.preferences import PreferencesDialog
from app.ui.render import RenderedMessage
from app.ui.sidebar import Sidebar
from app.worker import WorkerThread
from sessions import paths
from sessions.cachefiles import CacheIndex
from sessions.conversations import ConversationStore
from sessions.db import open_db
from sessions.settings import Settings

# Show a progress bar only for prefill or restore that takes longer than this.
PROGRESS_AFTER_MS = 500


def restore_text(source: str, tokens: int, seconds: float) -> str:
    if source == "disk":
        took = f"{seconds * 1000:.0f} ms" if seconds < 0.1 else f"{seconds:.2f} s"
        return f"Resumed from saved cache: {tokens:,} tokens in {took}"
    if source == "memory":
        return f"Continuing: {tokens:,} tokens already in memory"
    return "Reading the conversation from the start"


class MainWindow(QMainWindow):
    # Requests to the worker thread (queued: the worker lives on its own thread).
    load_model_requested = Signal(str)
    send_requested = Signal(int, str)
    regenerate_requested = Signal(int)
    edit_requested = Signal(int, str)

    def __init__(self) -> None:
        super().__init__()
        self.setWindowTitle("Reprise")
        self.resize(1100, 720)
        self.db = open_db()
        self.store = ConversationStore(self.db)
        self.settings = Settings(self.db)
        self.index = CacheIndex(self.db)
        self.conversation_id: int | None = None
        self.generating = False
        self._turn_clock = QElapsedTimer()

        self.sidebar = Sidebar()
        self.chat = ChatView()
        self.composer = Composer()
        self.model_picker = QComboBox()
        self.model_picker.setMinimumWidth(240)
        self.model_state = QLabel("Loading model…")
        # Loading reports no steps: a busy bar beside the picker until the model is ready.
        self.model_loading = QProgressBar()
        self.model_loading.setRange(0, 0)
        self.model_loading.setMaximumWidth(120)
        self.status_text = QLabel("")
        self.stats_text = QLabel("")
        self.progress = QProgressBar()
        self.progress.setMaximumWidth(200)
        self.progress.hide()
        # Restoring a cache reports no steps: show a busy bar if the reply is slow to start.
        self._slow_start = QTimer(self, singleShot=True, interval=PROGRESS_AFTER_MS)
        self._slow_start.timeout.connect(self.on_slow_start)
        self._build_layout()
        self._build_actions()

        self.engine = WorkerThread()
        self._wire()
        self.refresh_models()
        self.refresh_sidebar()
        self.show_conversation(None)
        self.composer.edit.setFocus()  # open ready to type
        self.load_model_requested.emit(self.model_picker.currentText())

    # -- layout and wiring -----------------------------------------------------

    def _build_layout(self) -> None:
        right = QWidget()
        column = QVBoxLayout(right)
        column.addWidget(self.chat, 1)
        column.addWidget(self.composer)
        splitter = QSplitter()
        splitter.addWidget(self.sidebar)
        splitter.addWidget(right)
        splitter.setStretchFactor(1, 1)
        splitter.setSizes([260, 840])
        self.setCentralWidget(splitter)
        toolbar = QToolBar("Model")
        toolbar.setMovable(False)
        toolbar.addWidget(QLabel(" Model: "))
        toolbar.addWidget(self.model_picker)
        toolbar.addWidget(QLabel("  "))
        toolbar.addWidget(self.model_state)
        # A toolbar shows or hides its widgets through their actions.
        self.model_loading_action = toolbar.addWidget(self.model_loading)
        self.addToolBar(toolbar)
        self.statusBar().addWidget(self.status_text, 1)
        self.statusBar().addPermanentWidget(self.progress)
        self.statusBar().addPermanentWidget(self.stats_text)

    def _build_actions(self) -> None:
        def action(text: str, shortcut, slot) -> QAction:
            item = QAction(text, self)
            item.setShortcut(shortcut)
            item.triggered.connect(slot)
            self.addAction(item)
            return item

        menu = self.menuBar().addMenu("&File")
        menu.addAction(action("New chat", QKeySequence.StandardKey.New, self.new_chat))
        menu.addAction(
            action("Find in chats", QKeySequence.StandardKey.Find, self.sidebar.search.setFocus)
        )
        preferences = QKeySequence(QKeySequence.StandardKey.Preferences)
        menu.addAction(
            action(
                "Preferences…",
                preferences if not preferences.isEmpty() else QKeySequence("Ctrl+,"),
                self.open_preferences,
            )
        )
        menu.addAction(action("Models…", QKeySequence("Ctrl+Shift+M"), self.open_models))
        menu.addSeparator()
        menu.addAction(action("Quit", QKeySequence.StandardKey.Quit, self.close))

    def _wire(self) -> None:
        worker = self.engine.worker
        self.load_model_requested.connect(worker.load_model)
        self.send_requested.connect(worker.send)
        self.regenerate_requested.connect(worker.regenerate)
        self.edit_requested.connect(worker.edit)
        worker.model_loaded.connect(self.on_model_loaded)
        worker.text_delta.connect(self.chat.add_text)
        worker.text_delta.connect(self.on_first_text)
        worker.prompt_progress.connect(self.on_prompt_progress)
        worker.cache_restored.connect(self.on_cache_restored)
        worker.finished.connect(self.on_finished)
        worker.failed.connect(self.on_failed)
        worker.saved.connect(self.on_saved)
        worker.busy_changed.connect(self.on_busy)
        self.composer.send_requested.connect(self.send)
        # Direct, not queued: the worker thread is busy generating; this only sets a flag.
        self.composer.stop_requested.connect(worker.stop, Qt.ConnectionType.DirectConnection)
        self.chat.action.connect(self.on_chat_action)
        self.sidebar.new_requested.connect(self.new_chat)
        self.sidebar.conversation_selected.connect(self.show_conversation)
        self.sidebar.search_changed.connect(self.refresh_sidebar)
        self.sidebar.rename_requested.connect(self.rename)
        self.sidebar.delete_requested.connect(self.delete)
        self.sidebar.export_requested.connect(self.export)
        self.model_picker.activated.connect(self.on_model_picked)

    # -- models ----------------------------------------------------------------

    def refresh_models(self) -> None:
        names = [m.name for m in list_models(paths.models_dir())]
        chosen = self.settings.get("model")
        self.model_picker.clear()
        self.model_picker.addItems(names)
        if chosen in names:
            self.model_picker.setCurrentText(chosen)
        elif "SmolLM2-135M-Instruct" in names:
            self.model_picker.setCurrentText("SmolLM2-135M-Instruct")

    def on_model_picked(self) -> None:
        name = self.model_picker.currentText()
        self.settings.set("model", name)
        self.model_state.setText("Loading model…")
        self.model_loading_action.setVisible(True)
        self.load_model_requested.emit(name)

    def on_model_loaded(self, name: str, compute: str) -> None:
        self.model_state.setText(f"Ready ({compute})")
        self.model_loading_action.setVisible(False)
        self.model_picker.setCurrentText(name)

    # -- conversations -----------------------------------------------------------

    def refresh_sidebar(self, *_args) -> None:
        query = self.sidebar.search.text().strip()
        caches = {c["conversation_id"]: c for c in self.index.conversations_summary()}
        if query:
            seen: dict[int, str] = {}
            for conversation, _message in self.store.search(query):
                seen.setdefault(conversation.id, conversation.title)
            entries = [(cid, title, caches.get(cid)) for cid, title in seen.items()]
        else:
            entries = [(c.id, c.title, caches.get(c.id)) for c in self.store.list()]
        self.sidebar.show_conversations(entries, self.conversation_id)

    def new_chat(self) -> None:
        if not self.generating:
            self.show_conversation(None)
            self.composer.edit.setFocus()

    def show_conversation(self, conversation_id: int | None) -> None:
        if self.generating:
            return
        self.conversation_id = conversation_id
        self.chat.show_messages(self._rendered(conversation_id))
        self.status_text.setText("")

    def _rendered(self, conversation_id: int | None) -> list[RenderedMessage]:
        if conversation_id is None:
            return []
        messages = self.store.get(conversation_id).messages
        rendered = []
        for i, m in enumerate(messages):
            siblings = self.store.siblings(m.id)
            index = [s.id for s in siblings].index(m.id) + 1
            rendered.append(
                RenderedMessage(
                    m.id,
                    m.role,
                    m.content,
                    m.state,
                    (index, len(siblings)),
                    is_last=i == len(messages) - 1,
                )
            )
        return rendered

    # -- a turn --------------------------------------------------------------------

    def send(self, text: str) -> None:
        if self.conversation_id is None:
            conversation = self.store.create(self.model_picker.currentText())
            self.conversation_id = conversation.id
        self.chat.append_streaming(RenderedMessage(-1, "user", text))
        self._start_turn()
        self.send_requested.emit(self.conversation_id, text)

    def regenerate(self) -> None:
        if self.chat.messages and self.chat.messages[-1].role == "assistant":
            self.chat.messages.pop()
        self._start_turn()
        self.regenerate_requested.emit(self.conversation_id)

    def edit(self, message_id: int) -> None:
        message = self.store.message(message_id)
        text, ok = QInputDialog.getMultiLineText(
            self, "Edit message", "Your message:", message.content
        )
        if not ok or not text.strip() or text == message.content:
            return
        ids = [m.id for m in self.chat.messages]
        self.chat.messages = self.chat.messages[: ids.index(message_id)]
        self.chat.append_streaming(RenderedMessage(-1, "user", text))
        self._start_turn()
        self.edit_requested.emit(message_id, text)

    def _start_turn(self) -> None:
        self.chat.append_streaming(RenderedMessage(-2, "assistant", "", state="streaming"))
        self._turn_clock.start()
        self._slow_start.start()
        self.status_text.setText("Thinking…")

    def on_chat_action(self, verb: str, message_id: int) -> None:
        if self.generating:
            return
        if verb == "regenerate":
            self.regenerate()
        elif verb == "edit":
            self.edit(message_id)
        elif verb in ("branch-prev", "branch-next"):
            siblings = [s.id for s in self.store.siblings(message_id)]
            step = -1 if verb == "branch-prev" else 1
            target = siblings[(siblings.index(message_id) + step) % len(siblings)]
            self.store.select_branch(self.conversation_id, target)
            self.show_conversation(self.conversation_id)

    def on_busy(self, busy: bool) -> None:
        self.generating = busy
        self.composer.set_generating(busy)
        if not busy:
            self._slow_start.stop()
            self.progress.hide()

    def on_slow_start(self) -> None:
        if self.generating and not self.progress.isVisible():
            self.progress.setRange(0, 0)  # busy, no steps
            self.progress.setFormat("Preparing…")
            self.progress.show()

    def on_first_text(self, _text: str) -> None:
        if self._slow_start.isActive() or self.progress.maximum() == 0:
            self._slow_start.stop()
            self.progress.hide()

    def on_prompt_progress(self, done: int, total: int) -> None:
        if done >= total:
            self.progress.hide()
            return
        if self._turn_clock.isValid() and self._turn_clock.elapsed() > PROGRESS_AFTER_MS:
            self.progress.setRange(0, total)
            self.progress.setValue(done)
            self.progress.setFormat(f"Reading {done:,}/{total:,} tokens")
            self.progress.show()

    def on_cache_restored(self, source: str, tokens: int, seconds: float) -> None:
        first_turn = len(self.chat.messages) <= 2  # the question and the coming reply
        self.status_text.setText("" if first_turn else restore_text(source, tokens, seconds))

    def on_finished(self, stats: dict) -> None:
        self.progress.hide()
        if self.conversation_id is not None:
            self.chat.show_messages(self._rendered(self.conversation_id))
        context = stats["prompt_tokens"] + stats["generated_tokens"]
        kv_format = stats["kv_format"]  # "4-bit (group 64, ...)": the detail goes in a tooltip
        self.stats_text.setText(
            f"{stats['decode_tps']:.1f} tok/s · context {context:,} tokens · "
            f"KV {stats['kv_bytes'] / 1e6:.1f} MB ({kv_format.split(' (')[0]})"
        )
        self.stats_text.setToolTip(f"KV cache: {kv_format}")
        if stats["finish_reason"] == "cancelled":
            self.status_text.setText("Stopped")
        self.refresh_sidebar()

    def on_saved(self, report: dict) -> None:
        if report.get("error"):
            self.status_text.setText(f"The cache was not saved: {report['error']}")
        self.refresh_sidebar()

    def on_failed(self, message: str) -> None:
        self.progress.hide()
        if not self.model_state.text().startswith("Ready"):
            self.model_state.setText("No model loaded")
            self.model_loading_action.setVisible(False)
        if self.conversation_id is not None:
            self.chat.show_messages(self._rendered(self.conversation_id))
        self.status_text.setText(message.splitlines()[0])
        QMessageBox.warning(self, "Reprise", message)

    # -- sidebar actions ---------------------------------------------------------------

    def rename(self, conversation_id: int) -> None:
        current = self.store.get(conversation_id).title
        title, ok = QInputDialog.getText(self, "Rename", "Title:", text=current)
        if ok and title.strip():
            self.store.rename(conversation_id, title)
            self.refresh_sidebar()

    def delete(self, conversation_id: int) -> None:
        title = self.store.get(conversation_id).title or "this chat"
        answer = QMessageBox.question(self, "Delete", f"Delete “{title}” and its cache?")
        if answer != QMessageBox.StandardButton.Yes:
            return
        self.store.delete(conversation_id)
        self.index.collect_garbage()
        if self.conversation_id == conversation_id:
            self.show_conversation(None)
        self.refresh_sidebar()

    def export(self, conversation_id: int, fmt: str) -> None:
        suffix = ".md" if fmt == "markdown" else ".json"
        title = self.store.get(conversation_id).title or "chat"
        name, _ = QFileDialog.getSaveFileName(self, "Export", str(Path.home() / f"{title}{suffix}"))
        if name:
            Path(name).write_text(self.store.export(conversation_id, fmt))

    # -- dialogs -----------------------------------------------------------------------

    def open_preferences(self) -> None:
        dialog = PreferencesDialog(self.settings, self.index.usage()[1], self)
        dialog.clear_caches_requested.connect(self.clear_caches)
        dialog.exec()

    def clear_caches(self) -> None:
        self.index.clear()
        self.refresh_sidebar()

    def open_models(self) -> None:
        from app.ui.models_dialog import ModelsDialog

        dialog = ModelsDialog(self.engine.worker, self)
        dialog.exec()
        self.refresh_models()

    # -- quitting ------------------------------------------------------------------------

    def closeEvent(self, event) -> None:
        """Stop a reply, let the worker finish its save, then go."""
        self.engine.worker.stop()
        self.engine.thread.quit()
        clock = QElapsedTimer()
        clock.start()
        waiting = None
        while not self.engine.thread.wait(50):
            if waiting is None and clock.elapsed() > PROGRESS_AFTER_MS:
                waiting = QProgressDialog("Saving the conversation…", "", 0, 0, self)
                waiting.setCancelButton(None)
                waiting.setWindowModality(Qt.WindowModality.WindowModal)
                waiting.show()
            QApplication.processEvents()
        if waiting is not None:
            waiting.close()
        event.accept()
