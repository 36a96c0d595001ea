"""The window by keyboard: Tab leaves the message box, Esc stops, shortcuts for the rest,
all listed in the Help menu."""

from __future__ import annotations

from gui_window import (
    READY_MS,
    prefer,
    send,
    start_long_reply,
    wait_reply,
    wait_streaming,
    when_a_box_opens,
)
from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QApplication, QInputDialog, QTableWidget

from app import __version__
from app.ui.menus import about_text, shortcut_list

CTRL = Qt.KeyboardModifier.ControlModifier
SHIFT = Qt.KeyboardModifier.ShiftModifier


def active(qtbot, window):
    window.activateWindow()
    qtbot.waitUntil(window.isActiveWindow, timeout=5_000)
    return window


def test_tab_leaves_the_message_box(qtbot, open_window):
    window = active(qtbot, open_window())
    box = window.composer.edit
    box.setFocus()
    box.setPlainText("draft")
    qtbot.keyClick(box, Qt.Key.Key_Tab)
    assert box.toPlainText() == "draft"  # no tab typed
    assert not box.hasFocus()
    qtbot.keyClick(QGuiApplication.focusObject(), Qt.Key.Key_Backtab)
    assert box.hasFocus()


def test_escape_stops_a_reply(qtbot, open_window):
    window = active(qtbot, open_window())
    prefer(window, temperature=0.0, max_tokens=2000)  # greedy: the same long story each run
    window.composer.edit.setPlainText("Write a long story about a lighthouse keeper.")
    qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    wait_streaming(qtbot, window)
    qtbot.keyClick(window.composer.edit, Qt.Key.Key_Escape)
    wait_reply(qtbot, window)
    assert window.store.get(window.conversation_id).messages[-1].state == "cancelled"


def test_a_shortcut_with_nothing_to_act_on_says_so(qtbot, open_window):
    """A new user's walk: Ctrl+R, F2 and Ctrl+Shift+D on a new chat did nothing at all."""
    from app.ui.menus import NO_CHAT_YET, NO_REPLY_YET

    window = active(qtbot, open_window())
    box = window.composer.edit
    box.setFocus()
    for key, modifiers, said in (
        (Qt.Key.Key_R, CTRL, NO_REPLY_YET),
        (Qt.Key.Key_F2, Qt.KeyboardModifier.NoModifier, NO_CHAT_YET),
        (Qt.Key.Key_D, CTRL | SHIFT, NO_CHAT_YET),
        (Qt.Key.Key_C, CTRL | SHIFT, "There is no reply to copy yet"),
    ):
        window.status.say("")
        qtbot.keyClick(box, key, modifiers)
        assert window.status.message.text() == said, key
    assert window.conversation_id is None and not window.generating


def test_shortcuts_copy_switch_chats_and_find(qtbot, open_window):
    window = active(qtbot, open_window())
    send(qtbot, window, "Tell me about penguins.", greedy_tokens=8)
    first = window.conversation_id
    window.new_chat()
    send(qtbot, window, "Tell me about volcanoes.", greedy_tokens=8)
    second = window.conversation_id
    box = window.composer.edit

    qtbot.keyClick(box, Qt.Key.Key_C, CTRL | SHIFT)
    assert QGuiApplication.clipboard().text() == window.chat.messages[-1].content
    qtbot.keyClick(box, Qt.Key.Key_PageDown, CTRL)  # the list is newest first
    assert window.conversation_id == first
    assert window.chat.messages[0].content == "Tell me about penguins."
    qtbot.keyClick(box, Qt.Key.Key_PageUp, CTRL)
    assert window.conversation_id == second
    qtbot.keyClick(box, Qt.Key.Key_F, CTRL)
    assert window.sidebar.search.hasFocus()

    with qtbot.waitSignal(window.engine.worker.finished, timeout=READY_MS):
        qtbot.keyClick(window.sidebar.search, Qt.Key.Key_R, CTRL)  # regenerate
    wait_reply(qtbot, window)
    assert window.chat.messages[-1].branch == (2, 2)


def test_the_help_menu_lists_the_shortcuts_and_the_version(qtbot, open_window):
    window = open_window()
    menus = [a.text() for a in window.menuBar().actions()]
    assert menus == ["&File", "&Chat", "&Help"]
    help_items = [a.text() for a in window.menuBar().actions()[-1].menu().actions()]
    assert help_items == ["Keyboard shortcuts", "About Reprise"]
    listed = shortcut_list(window)
    for line in (
        "Esc\tStop the reply, or leave an edit",
        "Ctrl+R\tRegenerate",
        "Ctrl+Shift+C\tCopy the last",
        "in the chat\tMove through a message's actions",
    ):
        assert line in listed
    assert f"Reprise {__version__}" in about_text()
    assert window.windowTitle() == f"Reprise {__version__}"


def test_the_shortcuts_are_a_table_of_keys_and_what_they_do(qtbot, open_window):
    window = active(qtbot, open_window())
    shown = []

    def look() -> None:
        dialog = QApplication.activeModalWidget()
        table = dialog.findChild(QTableWidget) if dialog else None
        if table is not None:
            cells = [
                [table.item(r, c).text() for c in range(table.columnCount())]
                for r in range(table.rowCount())
            ]
            longest = max(table.fontMetrics().horizontalAdvance(keys) for keys, _ in cells)
            shown.append((cells, table.columnWidth(0), longest))
        dialog.reject()

    QTimer.singleShot(300, look)
    window.menuBar().actions()[-1].menu().actions()[0].trigger()  # Help → Keyboard shortcuts
    assert shown, "no table of shortcuts"
    cells, keys_width, longest = shown[0]
    assert cells[0] == ["Tab / Shift+Tab", "Move between the message box, the chat and the sidebar"]
    assert ["Ctrl+R", "Regenerate the last reply"] in cells
    assert len(cells) == len(shortcut_list(window).splitlines())
    # The keys' column holds its longest entry whole: the second column starts after it.
    assert keys_width > longest


def test_f2_renames_the_chat_on_screen_without_the_mouse(qtbot, open_window):
    window = active(qtbot, open_window())
    send(qtbot, window, "Hello", greedy_tokens=3)
    widths = []

    def rename(box: QInputDialog) -> None:
        widths.append(box.width() / box.fontMetrics().averageCharWidth())
        box.setTextValue("Greetings")
        box.accept()

    when_a_box_opens(rename, title="Rename")
    qtbot.keyClick(window.composer.edit, Qt.Key.Key_F2)
    qtbot.waitUntil(
        lambda: window.store.get(window.conversation_id).title == "Greetings", timeout=5_000
    )
    assert widths[0] >= 40  # a title shows whole (a new-user walk found about 20 characters)
    assert "F2\tRename this chat" in shortcut_list(window)
    assert "Ctrl+Shift+D\tDelete this chat" in shortcut_list(window)


def test_escape_stops_a_reply_wherever_focus_is(qtbot, open_window):
    window = active(qtbot, open_window())
    prefer(window, temperature=0.0, max_tokens=2000)  # greedy: the same long story each run
    for place in (window.chat, window.sidebar.list, window.sidebar.search):
        window.composer.edit.setPlainText("Write a long story about a lighthouse keeper.")
        qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
        wait_streaming(qtbot, window)
        place.setFocus()
        qtbot.waitUntil(place.hasFocus, timeout=5_000)
        qtbot.keyClick(place, Qt.Key.Key_Escape)
        wait_reply(qtbot, window)
        assert window.store.get(window.conversation_id).messages[-1].state == "cancelled"
    qtbot.keyClick(window.chat, Qt.Key.Key_Escape)  # nothing streams: nothing happens
    assert not window.generating
    assert window.store.get(window.conversation_id).messages[-1].state == "cancelled"


def test_alt_letters_open_the_menus_from_the_message_box(qtbot, open_window):
    window = active(qtbot, open_window())
    box = window.composer.edit
    box.setFocus()
    for letter, title in (
        (Qt.Key.Key_F, "&File"),
        (Qt.Key.Key_C, "&Chat"),
        (Qt.Key.Key_H, "&Help"),
    ):
        qtbot.keyClick(box, letter, Qt.KeyboardModifier.AltModifier)
        qtbot.waitUntil(lambda: window.menuBar().activeAction() is not None, timeout=5_000)
        assert window.menuBar().activeAction().text() == title
        qtbot.keyClick(QGuiApplication.focusObject() or window, Qt.Key.Key_Escape)
        qtbot.keyClick(QGuiApplication.focusObject() or window, Qt.Key.Key_Escape)
        box.setFocus()
    assert box.toPlainText() == ""


def test_keyboard_only_regenerates_through_the_reply_s_link(qtbot, open_window):
    window = active(qtbot, open_window())
    send(qtbot, window, "Tell me about penguins.", greedy_tokens=8)
    window.composer.edit.setFocus()
    for _ in range(40):  # Tab from the message box into the chat and through its links
        qtbot.keyClick(QGuiApplication.focusObject(), Qt.Key.Key_Tab)
        if window.chat.hasFocus() and "Regenerate" in window.chat.textCursor().selectedText():
            break
    assert "Regenerate" in window.chat.textCursor().selectedText()
    with qtbot.waitSignal(window.engine.worker.finished, timeout=READY_MS):
        qtbot.keyClick(window.chat, Qt.Key.Key_Return)
    wait_reply(qtbot, window)
    assert window.chat.messages[-1].branch == (2, 2)


def test_escape_in_the_search_box_clears_the_search(qtbot, open_window):
    window = active(qtbot, open_window())
    window.sidebar.search.setFocus()
    qtbot.keyClicks(window.sidebar.search, "lighthouse")
    qtbot.keyClick(window.sidebar.search, Qt.Key.Key_Escape)
    assert window.sidebar.search.text() == ""


def answer_the_box(qtbot, press, title: str) -> list:
    """When the box titled `title` comes up, note its default button, then `press(box)`."""
    seen = []
    when_a_box_opens(lambda box: seen.append(box.defaultButton().text()) or press(box), title)
    return seen


def test_enter_in_the_delete_box_keeps_the_chat_and_deleting_the_open_one_clears_it(
    qtbot,
    open_window,
):
    window = open_window()
    send(qtbot, window, "Say hello.", greedy_tokens=4)
    chat = window.conversation_id
    seen = answer_the_box(qtbot, lambda box: qtbot.keyClick(box, Qt.Key.Key_Return), "Delete")
    window.actions.delete(chat)
    assert seen == ["&No"] and window.store.get(chat).id == chat  # Enter: kept
    yes = lambda box: box.button(box.StandardButton.Yes).click()  # noqa: E731
    answer_the_box(qtbot, yes, "Delete")
    window.actions.delete(chat)
    # The chat on screen is gone: an empty new chat takes its place, not the old view.
    qtbot.waitUntil(lambda: window.sidebar.list.count() == 0, timeout=10_000)
    assert window.conversation_id is None and window.chat.messages == []


def test_deleting_the_open_chat_shows_the_one_listed_next_to_it(qtbot, open_window):
    """Two new-user walks expected the chat below (or above) to take its place, as in
    other chat apps, not an empty new chat."""
    window = open_window()
    send(qtbot, window, "Say hello.", greedy_tokens=4)
    older = window.conversation_id
    window.new_chat()
    send(qtbot, window, "Say goodbye.", greedy_tokens=4)
    newer = window.conversation_id  # listed first, the older one below it
    yes = lambda box: box.button(box.StandardButton.Yes).click()  # noqa: E731
    answer_the_box(qtbot, yes, "Delete")
    window.actions.delete(newer)
    qtbot.waitUntil(lambda: window.conversation_id == older, timeout=10_000)
    assert window.chat.messages[0].content == "Say hello."
    assert window.sidebar.list.currentItem().data(Qt.ItemDataRole.UserRole) == older


def test_a_chat_shortcut_during_a_reply_says_why_it_waits(qtbot, open_window):
    """A new user's walk: Ctrl+R while a reply was written did nothing, and said nothing."""
    window = active(qtbot, open_window())
    start_long_reply(qtbot, window)
    for key, modifiers in ((Qt.Key.Key_R, CTRL), (Qt.Key.Key_F2, Qt.KeyboardModifier.NoModifier)):
        window.status.say("")
        qtbot.keyClick(window.composer.edit, key, modifiers)
        assert window.status.message.text() == "A reply is being written: stop it (Esc) first"
    qtbot.keyClick(window.composer.edit, Qt.Key.Key_Escape)
    qtbot.waitUntil(lambda: not window.generating, timeout=READY_MS)
    assert window.status.message.text() != "A reply is being written: stop it (Esc) first"


def test_the_shortcut_rows_have_room_for_the_focus_ring(qtbot, open_window):
    """A new user's walk: the focus ring cut the tops of the letters off."""
    from app.ui.menus import shortcuts_dialog

    dialog = shortcuts_dialog(open_window())
    qtbot.addWidget(dialog)
    table = dialog.findChild(QTableWidget)
    assert table.rowHeight(0) >= table.fontMetrics().height() + 6, table.rowHeight(0)



def test_no_two_actions_share_a_shortcut(qtbot, open_window):
    """Where the platform had no standard Quit key, Quit got Preferences' Ctrl+, too, and
    a shortcut on two actions runs neither."""
    from app.ui.menus import shortcut_rows

    keys = [keys for keys, _ in shortcut_rows(open_window())]
    assert len(keys) == len(set(keys)), keys


def test_f1_opens_the_keyboard_shortcuts(qtbot, open_window):
    window = active(qtbot, open_window())
    titles = []
    when_a_box_opens(lambda box: titles.append(box.windowTitle()) or box.close())
    qtbot.keyClick(window.composer.edit, Qt.Key.Key_F1)
    qtbot.waitUntil(lambda: titles == ["Keyboard shortcuts"], timeout=5_000)
    assert "F1\tThis list" in shortcut_list(window)


def test_letters_typed_in_the_chat_list_go_to_the_message_box(qtbot, open_window):
    """A new user's walk: after opening a search result with Enter, the keyboard stayed
    in the list, and what was typed next went nowhere."""
    window = active(qtbot, open_window())
    send(qtbot, window, "Say hello.", greedy_tokens=4)
    window.sidebar.list.setFocus()
    qtbot.waitUntil(window.sidebar.list.hasFocus, timeout=5_000)
    qtbot.keyClicks(window.sidebar.list, "Q")
    assert window.composer.edit.hasFocus()
    qtbot.keyClicks(QApplication.focusWidget(), "uite")
    assert window.composer.edit.toPlainText() == "Quite"


def test_after_a_click_on_send_typing_goes_to_the_message_box(qtbot, open_window):
    """A new user's walk: Send clicked left the keyboard on the button, Stop once the
    reply began; the next space stopped the reply and the words typed were lost."""
    window = active(qtbot, open_window())
    prefer(window, temperature=0.0, max_tokens=2000)
    window.composer.edit.setPlainText("Write a long story about a lighthouse keeper.")
    qtbot.mouseClick(window.composer.button, Qt.MouseButton.LeftButton)
    wait_streaming(qtbot, window)
    qtbot.keyClicks(QApplication.focusWidget(), "hello world")
    assert window.composer.edit.toPlainText() == "hello world"
    assert window.generating  # not stopped by the space
    qtbot.keyClick(window.composer.edit, Qt.Key.Key_Escape)
    qtbot.waitUntil(lambda: not window.generating, timeout=READY_MS)


def test_letters_typed_in_the_conversation_go_to_the_message_box(qtbot, open_window):
    """Found on a new-user walk: after a click on Regenerate the keyboard stayed in the
    conversation, and what was typed next went nowhere."""
    window = open_window()
    send(qtbot, window, "Say hello.", greedy_tokens=4)
    window.chat.setFocus()
    qtbot.waitUntil(window.chat.hasFocus, timeout=5_000)
    qtbot.keyClicks(window.chat, "A")
    assert window.composer.edit.hasFocus()
    qtbot.keyClicks(QApplication.focusWidget(), "nd Bye")  # the keyboard's next keys
    assert window.composer.edit.toPlainText() == "And Bye"
    window.chat.setFocus()
    qtbot.waitUntil(window.chat.hasFocus, timeout=5_000)
    qtbot.keyClick(window.chat, "@", Qt.KeyboardModifier.GroupSwitchModifier)  # AltGr
    assert window.composer.edit.toPlainText() == "And Bye@"
    # The view's own keys stay its own: Tab walks its links, Ctrl+A selects its text.
    window.chat.setFocus()
    qtbot.keyClick(window.chat, Qt.Key.Key_A, Qt.KeyboardModifier.ControlModifier)
    assert window.chat.hasFocus() and window.chat.textCursor().hasSelection()
    assert window.composer.edit.toPlainText() == "And Bye@"
