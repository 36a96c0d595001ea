"""The window's menus and keyboard shortcuts, listed once: the Help menu shows this list."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from PySide6.QtCore import Qt
from PySide6.QtGui import QAction, QGuiApplication, QKeySequence
from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QMessageBox,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
)

from app import __version__
from app.ui.preferences import PreferencesDialog
from app.ui.render import split_thinking
from app.ui.theme import RoomForTheRing

if TYPE_CHECKING:
    from app.ui.main_window import MainWindow

Keys = QKeySequence | QKeySequence.StandardKey | str


# A platform without these standard keys (Linux has no Preferences key; a bare one, such
# as Qt's offscreen, no Quit either) gets these. One fallback for both gave Quit Ctrl+,
# too: two actions on one shortcut, and neither ran.
_NO_STANDARD = {
    QKeySequence.StandardKey.Preferences: "Ctrl+,",
    QKeySequence.StandardKey.Quit: "Ctrl+Q",
}


def _keys(keys: Keys) -> QKeySequence:
    sequence = QKeySequence(keys)
    if sequence.isEmpty() and isinstance(keys, QKeySequence.StandardKey):
        return QKeySequence(_NO_STANDARD.get(keys, ""))
    return sequence


# A shortcut with nothing to act on says so in the status bar: a new user's walk pressed
# Ctrl+R, F2 and Ctrl+Shift+D on a new chat and saw nothing happen.
NO_CHAT_YET = "This chat has no messages yet: send one first"
NO_REPLY_YET = "There is no reply to regenerate yet"
# ... and Ctrl+R during a reply (a later walk): said, not ignored.
BUSY_REPLYING = "A reply is being written: stop it (Esc) first"
BUSY_ADDING = "A model is being added: try again once it is in"  # not queued: not "waits"


def say_busy(window: MainWindow) -> None:
    """Why a chat action does nothing now: the turn or the model's add under way."""
    window.status.say_while_busy(BUSY_REPLYING if window.replying else BUSY_ADDING)


def copy_last_reply(window: MainWindow) -> None:
    replies = [m for m in window.chat.messages if m.role == "assistant" and m.content]
    if replies:
        QGuiApplication.clipboard().setText(split_thinking(replies[-1].content)[1])
        window.status.say("Copied the last reply")
    else:
        window.status.say("There is no reply to copy yet")


def step_chat(window: MainWindow, step: int) -> None:
    """Show the next (1) or previous (-1) chat of the sidebar's list."""
    chats = window.sidebar.list
    if chats.count() and not window.generating:
        shown = chats.selectedItems()  # the current row may only hold the focus
        row = chats.row(shown[0]) if shown else -1
        chats.setCurrentRow(0 if row < 0 else max(0, min(chats.count() - 1, row + step)))


def regenerate_last(window: MainWindow) -> None:
    last = window.chat.messages[-1] if window.chat.messages else None
    if window.generating:
        say_busy(window)
        return
    if last is not None and last.role == "assistant":
        window.turns.on_chat_action("regenerate", 0)
    else:
        window.status.say(NO_REPLY_YET)


def stop_reply(window: MainWindow) -> None:
    """Esc: stop the reply; when none streams, clear a search being typed, or leave an
    edit (the draft comes back)."""
    search = window.sidebar.search
    if window.replying:
        window.composer.stop_requested.emit()
    elif search.hasFocus() and search.text():  # before a download's cancel (review)
        search.clear()
    elif window.generating:  # a model's download: Esc cancels it (the status bar says so)
        window.composer.stop_requested.emit()
    else:
        window.composer.cancel_edit()


def focus_search(window: MainWindow) -> None:
    window.sidebar.search.setFocus()
    window.sidebar.search.selectAll()


def on_this_chat(window: MainWindow, action: Callable[[int], None]) -> None:
    """What the sidebar's right-click menu does, for the chat on screen."""
    if window.generating:
        say_busy(window)
        return
    if window.conversation_id is None:
        window.status.say(NO_CHAT_YET)
        return
    action(window.conversation_id)


def open_preferences(window: MainWindow) -> None:
    dialog = preferences_dialog(window)
    if dialog.exec() and dialog.chosen is not None:
        window.ask_to_save(dialog.chosen)


def preferences_dialog(window: MainWindow) -> PreferencesDialog:
    """The Preferences, wired to the window: Clear caches asks the worker, and the size
    shown follows what the worker did."""
    device = "gpu" if window.models.compute.startswith("gpu") else "cpu"
    dialog = PreferencesDialog(window.preferences(), window.index.usage()[1], window, device)
    dialog.clear_caches_requested.connect(window.clear_caches_requested)
    dialog.follow_usage(window.engine.worker.changed, lambda: window.index.usage()[1])
    return dialog


def open_models(window: MainWindow) -> None:
    from app.ui.models_dialog import ModelsDialog

    in_use = window.models.current() if window.models.ready else ""
    dialog = ModelsDialog(window.engine.worker, window, in_use)
    window.library_open = True
    try:
        dialog.exec()
    finally:
        window.library_open = False
        dialog.deleteLater()  # kept, hidden, it would go on answering the worker's signals
    window.model_flow.refresh()
    if not (window.models.ready or window.models.awaited or window.model_flow.load_failed):
        window.model_flow.load_chosen()  # the library's first model, say


def menu_entries(window: MainWindow) -> dict[str, list[tuple[str, Keys, Callable[[], None]]]]:
    """Each menu's entries: (label, keys, what it does)."""
    export_markdown = partial(window.actions.export, fmt="markdown")
    return {
        "&File": [
            ("New chat", QKeySequence.StandardKey.New, window.new_chat),
            (
                "Preferences…",
                QKeySequence.StandardKey.Preferences,
                partial(open_preferences, window),
            ),
            ("Models…", "Ctrl+Shift+M", partial(open_models, window)),
            ("Quit", QKeySequence.StandardKey.Quit, window.close),
        ],
        "&Chat": [
            ("Stop the reply, or leave an edit", "Esc", lambda: stop_reply(window)),
            ("Regenerate the last reply", "Ctrl+R", lambda: regenerate_last(window)),
            ("Copy the last reply", "Ctrl+Shift+C", lambda: copy_last_reply(window)),
            ("Next chat", "Ctrl+PgDown", lambda: step_chat(window, 1)),
            ("Previous chat", "Ctrl+PgUp", lambda: step_chat(window, -1)),
            ("Find in chats", QKeySequence.StandardKey.Find, lambda: focus_search(window)),
            ("Write a message", "Ctrl+L", window.composer.edit.setFocus),
            ("Rename this chat…", "F2", lambda: on_this_chat(window, window.actions.rename)),
            ("Export this chat…", "Ctrl+E", lambda: on_this_chat(window, export_markdown)),
            (
                "Delete this chat…",
                "Ctrl+Shift+D",
                lambda: on_this_chat(window, window.actions.delete),
            ),
        ],
    }


def shortcut_rows(window: MainWindow) -> list[tuple[str, str]]:
    """The keyboard shortcuts, (keys, what they do), as the Help menu lists them."""
    rows = [
        ("Tab / Shift+Tab", "Move between the message box, the chat and the sidebar"),
        ("Enter / Shift+Enter", "Send / start a new line"),
        ("Tab, then Enter, in the chat", "Move through a message's actions, run one"),
        ("F1", "This list"),
    ]
    for entries in menu_entries(window).values():
        for label, keys, _ in entries:
            text = _keys(keys).toString(QKeySequence.SequenceFormat.NativeText)
            rows.append((text, label.rstrip("…")))
    return rows


def shortcut_list(window: MainWindow) -> str:
    """The same, as text: a line per shortcut, its keys and a tab before what it does."""
    return "\n".join(f"{keys}\t{does}" for keys, does in shortcut_rows(window))


def shortcuts_dialog(window: MainWindow) -> QDialog:
    """The shortcuts in a table of two columns, keys and what they do, each as wide as
    its longest entry (text with tabs lines up only by chance)."""
    rows = shortcut_rows(window)
    table = QTableWidget(len(rows), 2)
    table.setHorizontalHeaderLabels(["Keys", "Does"])
    table.verticalHeader().hide()
    table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
    table.setSelectionBehavior(QTableWidget.SelectionBehavior.SelectRows)
    table.setWordWrap(False)
    table.setItemDelegate(RoomForTheRing(table))
    for row, (keys, does) in enumerate(rows):
        table.setItem(row, 0, QTableWidgetItem(keys))
        table.setItem(row, 1, QTableWidgetItem(does))
    table.resizeColumnsToContents()
    table.resizeRowsToContents()
    table.horizontalHeader().setStretchLastSection(True)
    # Every row in view, no scrolling, as far as the screen allows.
    whole = table.horizontalHeader().sizeHint().height() + table.verticalHeader().length()
    table.setMinimumHeight(min(whole + 2 * table.frameWidth(), 640))
    buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
    dialog = QDialog(window)
    dialog.setWindowTitle("Keyboard shortcuts")
    dialog.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)  # made anew each time
    layout = QVBoxLayout(dialog)
    layout.addWidget(table)
    layout.addWidget(buttons)
    buttons.rejected.connect(dialog.reject)
    width = sum(table.columnWidth(c) for c in range(2)) + 4 * table.frameWidth() + 40
    dialog.resize(min(width, 900), dialog.sizeHint().height())
    return dialog


def about_text() -> str:
    return (
        f"Reprise {__version__}\n\nChat with local language models on MLX. Conversations "
        "and their KV caches stay on this computer."
    )


def build_menus(window: MainWindow) -> None:
    for title, entries in menu_entries(window).items():
        menu = window.menuBar().addMenu(title)
        for label, keys, run in entries:
            item = QAction(label, window)
            item.setShortcut(_keys(keys))
            item.triggered.connect(run)
            window.addAction(item)
            menu.addAction(item)
    help_menu = window.menuBar().addMenu("&Help")
    shortcuts = help_menu.addAction("Keyboard shortcuts", lambda: shortcuts_dialog(window).exec())
    shortcuts.setShortcut(QKeySequence.StandardKey.HelpContents)  # F1
    help_menu.addAction("About Reprise", lambda: QMessageBox.about(window, "About", about_text()))
