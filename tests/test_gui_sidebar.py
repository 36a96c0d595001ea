"""The sidebar says when each chat was last used, and a search shows the matching text."""

from __future__ import annotations

from datetime import date

from gui_window import send

from app.ui.reading import sidebar_entries
from app.ui.sidebar import MARKED_ROLE, Sidebar, SidebarEntry, day_label, marked, snippet
from sessions.cachefiles import CacheIndex
from sessions.conversations import ConversationStore
from sessions.db import open_db


def test_days_read_as_a_person_says_them():
    today = date(2026, 12, 3)  # a Thursday
    assert day_label("2026-12-03T09:00:00+00:00", today) == "Today"
    assert day_label("2026-12-02T12:00:00+00:00", today) == "Yesterday"
    assert day_label("2026-11-30T12:00:00+00:00", today) == "Monday"
    assert day_label("2026-10-01T12:00:00+00:00", today) == "2026-10-01"
    assert day_label("not a time", today) == ""


def test_a_snippet_is_the_text_around_the_match():
    text = "Penguins live in the south. " * 3 + "Some volcanoes are under the sea ice. " * 3
    piece = snippet(text, "volcanoes")
    assert "volcanoes" in piece and piece.startswith("…") and piece.endswith("…")
    assert snippet("short text", "absent") == "short text"


def test_the_list_shows_days_and_search_snippets(qtbot, open_window):
    window = open_window()
    send(qtbot, window, "Tell me about penguins in the snow.", greedy_tokens=8)
    first, second = window.sidebar.list.item(0).text().splitlines()[:2]
    assert first.startswith("Tell me about penguins")
    assert second.startswith("Today · ")
    window.sidebar.search.setText("snow")
    lines = window.sidebar.list.item(0).text().splitlines()
    assert len(lines) == 3 and "snow" in lines[2]


def test_a_long_title_is_cut_with_an_ellipsis_not_scrolled_sideways(qtbot):
    sidebar = Sidebar()
    qtbot.addWidget(sidebar)
    sidebar.resize(260, 300)
    sidebar.show()
    title = "Explain the map function in Python and why it returns an iterator"
    sidebar.show_conversations([SidebarEntry(1, title, None, "2026-12-04T01:00:00")], 1)
    qtbot.waitUntil(lambda: sidebar.list.viewport().width() > 0, timeout=5_000)
    assert sidebar.list.horizontalScrollBar().maximum() == 0
    assert sidebar.list.item(0).toolTip() == title  # the whole title, on hover


def branched_chat() -> tuple[ConversationStore, CacheIndex]:
    """A question with two replies: the first made again, the second on screen."""
    db = open_db()
    store = ConversationStore(db)
    chat = store.create("SmolLM2-135M-Instruct", title="Birds")
    question = store.add_message(chat.id, "user", "Tell me about birds.")
    store.add_message(chat.id, "assistant", "Albatrosses glide over the ocean.", question.id)
    store.add_message(chat.id, "assistant", "Penguins swim in the ocean.", question.id)
    return store, CacheIndex(db)


def test_a_match_only_on_a_hidden_branch_says_so():
    store, index = branched_chat()
    [entry] = sidebar_entries(store, index, "albatrosses")
    assert entry.elsewhere and "Albatrosses" in entry.snippet
    [entry] = sidebar_entries(store, index, "ocean")  # on both: the one on screen
    assert not entry.elsewhere and "swim in the ocean" in entry.snippet
    sidebar = Sidebar()
    sidebar.search.setText("albatrosses")
    sidebar.show_conversations(sidebar_entries(store, index, "albatrosses"), None)
    assert sidebar.list.item(0).text().splitlines()[2].endswith("(on another branch)")


def test_the_matching_words_are_bold_in_the_result(qtbot):
    assert marked("Snow <falls>; more snow", "snow") == (
        "<b>Snow</b> &lt;falls&gt;; more <b>snow</b>"
    )
    sidebar = Sidebar()
    qtbot.addWidget(sidebar)
    sidebar.resize(260, 300)
    sidebar.show()
    sidebar.search.setText("snow")
    entry = SidebarEntry(1, "Weather", None, "2026-12-04T01:00:00", "Deep snow in the hills")
    sidebar.show_conversations([entry], None)
    item = sidebar.list.item(0)
    assert item.data(MARKED_ROLE) == "Deep <b>snow</b> in the hills"
    rect = sidebar.list.visualItemRect(item)
    assert rect.height() >= 3 * sidebar.list.fontMetrics().height()  # three lines drawn
    bold = sidebar.list.viewport().grab(rect).toImage()
    item.setData(MARKED_ROLE, "Deep snow in the hills")  # the same words, none bold
    plain = sidebar.list.viewport().grab(rect).toImage()
    assert bold != plain


def test_opening_a_match_on_a_hidden_branch_shows_that_branch(qtbot, open_window):
    branched_chat()  # in the app's database, before the window opens
    window = open_window()
    shown = lambda: [m.content for m in window.chat.messages]  # noqa: E731
    window.sidebar.search.setText("albatrosses")
    qtbot.waitUntil(lambda: window.sidebar.list.count() == 1, timeout=10_000)
    window.sidebar.list.setCurrentRow(0)  # what Down or a click does
    qtbot.waitUntil(lambda: "Albatrosses glide over the ocean." in shown(), timeout=30_000)
    assert "Penguins swim in the ocean." not in shown()
    window.sidebar.search.setText("ocean")  # on the branch now on screen: opened as it is
    qtbot.waitUntil(lambda: window.sidebar.list.count() == 1, timeout=10_000)
    window.sidebar.list.setCurrentRow(-1)
    window.sidebar.list.setCurrentRow(0)
    qtbot.wait(500)
    assert "Albatrosses glide over the ocean." in shown()


def test_search_results_open_from_the_keyboard(qtbot, open_window):
    """Down (or Enter) in the search box opens the first result; Enter on a row in the
    list opens it."""
    from PySide6.QtCore import Qt

    window = open_window()
    send(qtbot, window, "Tell me about penguins.", greedy_tokens=4)
    first = window.conversation_id
    window.new_chat()
    send(qtbot, window, "Tell me about puffins.", greedy_tokens=4)
    window.new_chat()
    window.sidebar.search.setFocus()
    window.sidebar.search.setText("penguins")
    qtbot.waitUntil(lambda: window.sidebar.list.count() == 1, timeout=10_000)
    qtbot.keyClick(window.sidebar.search, Qt.Key.Key_Down)
    qtbot.waitUntil(lambda: window.conversation_id == first, timeout=10_000)
    assert window.sidebar.list.hasFocus()
    window.sidebar.search.setText("")  # every chat again; move to the other and press Enter
    qtbot.waitUntil(lambda: window.sidebar.list.count() == 2, timeout=10_000)
    other = next(
        r for r in range(2)
        if window.sidebar.list.item(r).data(Qt.ItemDataRole.UserRole) != first
    )  # fmt: skip
    window.sidebar.list.setCurrentRow(
        other, window.sidebar.list.selectionModel().SelectionFlag.NoUpdate
    )
    qtbot.keyClick(window.sidebar.list, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: window.conversation_id not in (None, first), timeout=10_000)


def test_a_chat_clicked_in_the_list_is_ready_to_type_into(qtbot, open_window):
    """Found on a new-user walk: after a click on a chat the keyboard stayed in the list,
    so typing did nothing until the message box was clicked too."""
    from PySide6.QtCore import Qt
    from PySide6.QtWidgets import QApplication

    window = open_window()
    send(qtbot, window, "Tell me about penguins.", greedy_tokens=4)
    first = window.conversation_id
    window.new_chat()
    window.sidebar.list.setFocus()
    qtbot.waitUntil(lambda: window.sidebar.list.count() == 1, timeout=10_000)
    item = window.sidebar.list.item(0)
    assert item.data(Qt.ItemDataRole.UserRole) == first
    where = window.sidebar.list.visualItemRect(item).center()
    qtbot.mouseClick(window.sidebar.list.viewport(), Qt.MouseButton.LeftButton, pos=where)
    qtbot.waitUntil(lambda: window.conversation_id == first, timeout=10_000)
    assert QApplication.focusWidget() is window.composer.edit


def test_a_count_or_restore_asked_for_a_chat_just_deleted_says_nothing(qtbot, open_window):
    """The window asks for the context count a moment after typing, and for a
    restore on selection; a chat deleted in between is no error for the user (CI
    found 'No conversation 1' in a box after deleting the open chat)."""
    window = open_window()
    send(qtbot, window, "Say hello.", greedy_tokens=4)
    chat = window.conversation_id
    with qtbot.waitSignal(window.engine.worker.changed, timeout=10_000):
        window.delete_requested.emit(chat)
    failed = []
    window.engine.worker.failed.connect(failed.append)
    window.engine.worker.select(chat)  # as if it were still on screen
    window.prefetch_requested.emit(chat)
    window.context_requested.emit(chat, "draft", 0)
    with qtbot.waitSignal(window.engine.worker.context_counted, timeout=10_000):
        window.context_requested.emit(0, "", 0)  # after the two: they have been served
    assert failed == []


def test_a_search_that_finds_nothing_says_so(qtbot, open_window):
    """Found on a new-user walk: an empty list, as if there were no chats at all."""
    from PySide6.QtCore import Qt

    window = open_window()
    send(qtbot, window, "Tell me about penguins.", greedy_tokens=4)
    window.sidebar.search.setText("zebras")
    qtbot.waitUntil(lambda: window.sidebar.list.count() == 0, timeout=10_000)
    assert window.sidebar.no_matches.isVisible()
    assert window.sidebar.no_matches.text() == "No message mentions “zebras”."
    window.sidebar.search.setText("Tell me a joke.")  # one full stop, not two (a walk)
    qtbot.waitUntil(lambda: window.sidebar.list.count() == 0, timeout=10_000)
    assert window.sidebar.no_matches.text() == "No message mentions “Tell me a joke.”"
    window.sidebar.search.setText("penguins")
    qtbot.waitUntil(lambda: window.sidebar.list.count() == 1, timeout=10_000)
    assert not window.sidebar.no_matches.isVisible()
    window.sidebar.search.setText("<b>zebras</b>")  # shown as typed, not as markup
    qtbot.waitUntil(lambda: window.sidebar.list.count() == 0, timeout=10_000)
    assert window.sidebar.no_matches.textFormat() == Qt.TextFormat.PlainText
    assert "<b>zebras</b>" in window.sidebar.no_matches.text()
    window.sidebar.search.clear()
    assert not window.sidebar.no_matches.isVisible()


def test_a_chat_whose_saved_state_lost_some_files_says_it_resumes_in_part():
    """Review: "resumes at once" was said of a chat whose files were partly evicted."""
    from app.ui.sidebar import describe_cache, saved_size

    whole = {"bytes": 5_500_000, "tokens": 600, "chunks": 3, "chunks_on_disk": 3}
    assert describe_cache(whole) == "resumes at once"
    assert saved_size(whole) == "Saved to resume it: 5.5 MB on disk"
    assert describe_cache(whole | {"chunks_on_disk": 2}) == "resumes in part"
    assert describe_cache(whole | {"bytes": 0, "chunks_on_disk": 0}) == "resumes by rereading"
    assert describe_cache(None, empty=True) == "no messages yet"


def test_a_new_chat_s_row_shows_its_message_while_the_reply_is_written(qtbot, open_window):
    """A new user's walk: "New chat · Today · no messages yet" until the reply ended."""
    from gui_window import READY_MS, start_long_reply

    window = open_window()
    start_long_reply(qtbot, window)
    row = window.sidebar.list.item(0).text()
    assert row.startswith("Write a long story") and "no messages yet" not in row
    window.composer.stop_requested.emit()
    qtbot.waitUntil(lambda: not window.generating, timeout=READY_MS)
