"""The message box as a user leaves it: each chat keeps its own unsent text, across
switches and restarts, and a reply keeps its chat on screen until it is stopped.
(Found on a new-user walk: the one box's text followed the user into every chat, where
Enter sent it; a draft was lost on quit; a click on another chat during a reply moved
the list's highlight and did nothing else.)"""

from __future__ import annotations

from gui_window import send, start_long_reply, wait_reply, when_a_box_opens
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QMessageBox


def click_chat(qtbot, window, conversation_id):
    """A mouse click on the chat's row in the sidebar."""
    rows = window.sidebar.list
    for row in range(rows.count()):
        item = rows.item(row)
        if item.data(Qt.ItemDataRole.UserRole) == conversation_id:
            where = rows.visualItemRect(item).center()
            qtbot.mouseClick(rows.viewport(), Qt.MouseButton.LeftButton, pos=where)
            return
    raise AssertionError(f"chat {conversation_id} is not in the list")


def switch_to(qtbot, window, conversation_id) -> str:
    """Click the chat's row, wait until it is on screen; the message box's text."""
    click_chat(qtbot, window, conversation_id)
    qtbot.waitUntil(lambda: window.conversation_id == conversation_id, timeout=10_000)
    return window.composer.edit.toPlainText()


def two_chats(qtbot, window) -> tuple[int, int]:
    send(qtbot, window, "Tell me about penguins.", greedy_tokens=4)
    first = window.conversation_id
    window.new_chat()
    send(qtbot, window, "Tell me about owls.", greedy_tokens=4)
    return first, window.conversation_id


def test_each_chat_keeps_its_own_draft(qtbot, open_window):
    window = open_window()
    first, second = two_chats(qtbot, window)
    box = window.composer.edit
    qtbot.keyClicks(box, "and their eggs?")  # typed into the second chat, not sent
    assert switch_to(qtbot, window, first) == ""  # the other chat's text did not follow
    qtbot.keyClicks(box, "and their feathers?")
    assert switch_to(qtbot, window, second) == "and their eggs?"
    window.new_chat()
    assert box.toPlainText() == ""
    assert switch_to(qtbot, window, first) == "and their feathers?"
    # Enter sends this chat's draft into this chat, and the draft is gone.
    qtbot.keyClick(box, Qt.Key.Key_Return)
    wait_reply(qtbot, window)
    assert window.store.get(first).messages[-2].content == "and their feathers?"
    assert "and their feathers?" not in [m.content for m in window.store.get(second).messages]
    assert box.toPlainText() == ""


def test_a_draft_outlives_a_restart_and_a_sent_one_does_not(qtbot, open_window):
    window = open_window()
    first, second = two_chats(qtbot, window)
    qtbot.keyClicks(window.composer.edit, "unfinished")
    switch_to(qtbot, window, first)
    qtbot.keyClicks(window.composer.edit, "also unfinished")
    window.close()  # Ctrl+Q

    again = open_window()  # opens the chat that was on screen: the first
    assert again.conversation_id == first
    assert again.composer.edit.toPlainText() == "also unfinished"
    assert switch_to(qtbot, again, second) == "unfinished"
    assert switch_to(qtbot, again, first) == "also unfinished"
    qtbot.keyClick(again.composer.edit, Qt.Key.Key_Return)
    wait_reply(qtbot, again)
    again.close()

    third = open_window()  # the first chat again, with nothing unsent now
    assert third.conversation_id == first
    assert third.composer.edit.toPlainText() == ""
    assert switch_to(qtbot, third, second) == "unfinished"


def test_a_chat_being_replied_to_stays_on_screen_and_says_how_to_leave(qtbot, open_window):
    window = open_window()
    first, second = two_chats(qtbot, window)
    start_long_reply(qtbot, window)
    click_chat(qtbot, window, first)
    assert window.conversation_id == second
    chosen = window.sidebar.list.currentItem()
    assert chosen is not None and chosen.data(Qt.ItemDataRole.UserRole) == second
    assert "stop it (Esc) to switch chats" in window.status.message.text()
    assert window.generating  # the reply goes on

    qtbot.keyClick(window.composer.edit, Qt.Key.Key_Escape)
    wait_reply(qtbot, window)
    switch_to(qtbot, window, first)


def test_a_chat_reopened_with_the_app_shows_its_latest_message(qtbot, open_window):
    """As switching chats does (a new-user walk found it at its top after a restart)."""
    window = open_window()
    lines = "\n".join(f"Line {i} of a long list." for i in range(80))
    send(qtbot, window, f"Count these lines:\n{lines}", greedy_tokens=4)
    window.close()

    again = open_window()
    bar = again.chat.verticalScrollBar()
    qtbot.waitUntil(lambda: bar.maximum() > 0, timeout=10_000)
    assert bar.value() == bar.maximum()


def test_a_chat_sent_to_stays_on_screen_before_its_reply_starts(qtbot, open_window):
    """The worker may not have begun (it may still be loading the model): a click on
    another chat then switched, the reply came into the chat on screen and the draft
    typed there was filed under the new chat (an adversarial review)."""
    window = open_window()
    first, second = two_chats(qtbot, window)
    window.new_chat()
    window.composer.edit.setPlainText("Tell me about geese.")
    window.composer.edit.submitted.emit()  # no events run between this and the click
    click_chat(qtbot, window, first)
    assert window.conversation_id is None  # the new chat, still
    qtbot.keyClicks(window.composer.edit, "and ducks?")
    wait_reply(qtbot, window)
    third = window.conversation_id
    assert third not in (None, first, second)
    assert switch_to(qtbot, window, first) == ""
    assert switch_to(qtbot, window, third) == "and ducks?"


def test_a_deleted_chats_draft_goes_with_it(qtbot, open_window):
    window = open_window()
    first, second = two_chats(qtbot, window)
    qtbot.keyClicks(window.composer.edit, "never sent")
    when_a_box_opens(lambda box: box.button(QMessageBox.StandardButton.Yes).click())
    window.actions.delete(second)
    qtbot.waitUntil(lambda: window.conversation_id == first, timeout=10_000)  # listed next
    assert window.composer.edit.toPlainText() == ""  # the first chat's draft: none
    assert window.drafts.drafts.get(second) == ""
    window.close()
    assert open_window().composer.edit.toPlainText() == ""  # the first chat's: none


def test_a_reader_scrolled_up_stays_there_when_the_reply_ends(qtbot, open_window):
    """An adversarial review: the finished reply's redraw took them to the end."""
    window = open_window()
    send(qtbot, window, "\n".join(f"Line {i} of a long list." for i in range(60)), 4)
    start_long_reply(qtbot, window)
    bar = window.chat.verticalScrollBar()
    qtbot.waitUntil(lambda: bar.maximum() > 200, timeout=10_000)
    bar.setValue(100)  # reading the list again
    qtbot.keyClick(window.composer.edit, Qt.Key.Key_Escape)
    wait_reply(qtbot, window)
    qtbot.wait(50)
    assert bar.value() == 100
    bar.setValue(bar.maximum())  # and one who reads at the end is kept there
    send(qtbot, window, "Thanks.", greedy_tokens=4)
    qtbot.waitUntil(lambda: bar.value() == bar.maximum(), timeout=5_000)


def test_the_window_opens_where_it_was_left(qtbot, open_window):
    """Found on a new-user walk: every start opened the window at its default size, the
    sidebar at its default width (`window.json`, the window's own, as the drafts are)."""
    window = open_window()
    window.resize(700, 520)  # within the test screen: Qt keeps a window on its screen
    window.splitter.setSizes([300, 400])
    qtbot.waitUntil(lambda: window.size().width() == 700, timeout=2_000)
    sidebar = window.splitter.sizes()[0]
    window.close()

    again = open_window()
    assert (again.width(), again.height()) == (700, 520)
    assert again.splitter.sizes()[0] == sidebar


def test_the_chat_on_screen_at_closing_is_the_one_opened_next(qtbot, open_window):
    """New-user walk: a chat clicked on in the sidebar and read, not written to, gave
    way at the next start to the chat with the newest messages."""
    window = open_window()
    send(qtbot, window, "The first chat.", greedy_tokens=2)
    first = window.conversation_id
    window.new_chat()
    send(qtbot, window, "The second chat, written to last.", greedy_tokens=2)
    second = window.conversation_id
    window.show_conversation(first)
    window.close()
    assert open_window().conversation_id == first

    from sessions import paths, window_state

    path = paths.data_dir() / window_state.FILE_NAME
    for gone in ("999", "two"):  # deleted since, or not an id: the newest
        window_state.save(path, {"conversation": gone})
        assert open_window().conversation_id == second


def test_a_damaged_window_file_opens_the_window_as_at_first(qtbot, open_window):
    from sessions import paths, window_state

    path = paths.data_dir() / window_state.FILE_NAME
    for damaged in ('{"geometry": "AAAA", "splitter": 7}', "[1, 2]", "\xff not json"):
        path.write_text(damaged, encoding="latin-1")
        window = open_window()
        assert (window.width(), window.height()) == (1100, 720)
        window.close()


def test_enter_while_a_reply_is_written_says_why_the_message_waits(qtbot, open_window):
    """New-user walk: Enter during a reply kept the text, rightly, and said nothing."""
    window = open_window()
    start_long_reply(qtbot, window)
    window.composer.edit.setPlainText("And then?")
    qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    assert window.composer.edit.toPlainText() == "And then?"
    assert window.status.message.text().startswith("A reply is being written: your message")
    qtbot.keyClick(window.composer.edit, Qt.Key.Key_Escape)
    wait_reply(qtbot, window)
    assert not window.status.message.text().startswith("A reply is being written")


def test_a_narrow_window_keeps_most_of_its_width_for_the_chat(qtbot, open_window):
    """New-user walk: at the smallest size the sidebar kept 250 of 640 px."""
    window = open_window()
    window.resize(640, 480)
    qtbot.waitUntil(lambda: window.width() == 640, timeout=2_000)
    sidebar, chat = window.splitter.sizes()
    assert chat >= 2 * sidebar, (sidebar, chat)
    assert window.sidebar.new_button.width() <= sidebar  # nothing of it cut off
