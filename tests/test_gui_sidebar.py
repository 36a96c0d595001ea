"""The sidebar says when each chat was last used, and a search shows the matching text."""

from __future__ import annotations

from datetime import date

from test_gui import library, open_window, send  # noqa: F401

from app.ui.sidebar import Sidebar, SidebarEntry, day_label, snippet


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


def test_the_list_shows_days_and_search_snippets(qtbot, open_window):  # noqa: F811
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
