"""Light and dark themes: the Theme preference, the window's palette, the chat's colours."""

from __future__ import annotations

import pytest
from pygments.styles import get_style_by_name
from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication, QLineEdit, QVBoxLayout, QWidget

from app.service.preferences import InvalidPreference, Preferences
from app.ui import theme
from app.ui.chat_view import ChatView
from app.ui.preferences import PreferencesDialog
from app.ui.render import RenderedMessage
from app.ui.sidebar import Sidebar, SidebarEntry
from sessions.conversations import ConversationStore
from sessions.db import open_db
from sessions.settings import Settings

Role = QPalette.ColorRole
CODE = "Here is one:\n\n```python\ndef double(x):\n    return x * 2  # twice\n```\n\nDone."


@pytest.fixture(autouse=True)
def back_to_system(qapp):
    """The theme belongs to the application, which outlives a test."""
    yield
    theme.choose("system")


def luminance(colour: QColor) -> float:
    def linear(c: float) -> float:
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (linear(c) for c in (colour.redF(), colour.greenF(), colour.blueF()))
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(a: str | QColor, b: str | QColor) -> float:
    """The WCAG contrast ratio of two colours (1 to 21)."""
    high, low = sorted((luminance(QColor(a)), luminance(QColor(b))), reverse=True)
    return (high + 0.05) / (low + 0.05)


def seed_conversation() -> None:
    store = ConversationStore(open_db())
    chat = store.create("SmolLM2-135M-Instruct", title="Doubling")
    question = store.add_message(chat.id, "user", "How do I double a number?")
    store.add_message(chat.id, "assistant", CODE, parent_id=question.id)


def test_the_theme_preference_round_trips_and_a_bad_one_is_system(qtbot, open_window):
    settings = Settings(open_db())
    Preferences(theme="dark").save(settings)
    assert Preferences.load(settings).theme == "dark"
    with pytest.raises(InvalidPreference, match="theme must be one of system, light, dark"):
        Preferences(theme="purple")
    settings.write({"theme": "purple"})  # an older or damaged row
    assert Preferences.load(settings).theme == "system"
    window = open_window()  # starts, in the system's colours (light offscreen)
    assert window.palette().color(Role.Window) == QColor(theme.LIGHT.roles[Role.Window])
    dialog = PreferencesDialog(window.preferences(), 0)
    qtbot.addWidget(dialog)
    assert dialog.theme.currentText() == "Same as the system"
    assert "desktop" in dialog.theme.toolTip()


def test_choosing_dark_in_preferences_recolours_the_open_window(qtbot, open_window):
    seed_conversation()
    window = open_window()
    window.sidebar.list.setCurrentRow(0)
    qtbot.waitUntil(lambda: len(window.chat.messages) == 2, timeout=5_000)
    before = window.chat.toPlainText()
    assert "return x * 2" in before
    light_html = window.chat.toHtml()
    assert theme.LIGHT.chat.user_bg in light_html and theme.LIGHT.chat.code_bg in light_html

    dialog = PreferencesDialog(window.preferences(), 0)
    qtbot.addWidget(dialog)
    dialog.theme.setCurrentIndex(dialog.theme.findData("dark"))
    dialog.accept()
    window.ask_to_save(dialog.chosen)

    dark_window = QColor(theme.DARK.roles[Role.Window])
    qtbot.waitUntil(lambda: window.palette().color(Role.Window) == dark_window, timeout=5_000)
    assert window.palette().color(Role.Window).lightness() < 80
    html = window.chat.toHtml()
    assert theme.DARK.chat.user_bg in html and theme.DARK.chat.code_bg in html
    assert theme.LIGHT.chat.user_bg not in html and theme.LIGHT.chat.code_bg not in html
    assert window.chat.toPlainText() == before  # the same transcript, only recoloured
    assert Preferences.load(Settings(open_db())).theme == "dark"  # and the next start's

    theme.choose("light")
    assert window.chat.toPlainText() == before
    assert theme.LIGHT.chat.code_bg in window.chat.toHtml()


def test_system_follows_the_desktop_while_running_unless_a_theme_is_chosen(qtbot):
    view = ChatView()
    qtbot.addWidget(view)
    view.show_messages([RenderedMessage(1, "user", "Hi"), RenderedMessage(2, "assistant", CODE)])
    theme.follow(view, "system")
    hints = QGuiApplication.styleHints()
    hints.colorSchemeChanged.emit(Qt.ColorScheme.Dark)  # what Qt sends when the desktop turns
    assert view.colours == theme.DARK.chat and theme.DARK.chat.code_bg in view.toHtml()
    assert QGuiApplication.palette().color(Role.Base) == QColor(theme.DARK.roles[Role.Base])
    hints.colorSchemeChanged.emit(Qt.ColorScheme.Light)
    assert view.colours == theme.LIGHT.chat
    theme.choose("dark")
    hints.colorSchemeChanged.emit(Qt.ColorScheme.Light)  # a chosen theme stays
    assert view.colours == theme.DARK.chat
    assert "return x * 2" in view.toPlainText()


@pytest.mark.parametrize("chosen", [theme.LIGHT, theme.DARK], ids=lambda t: t.name)
def test_text_is_readable_in_both_themes(qapp, chosen):
    """WCAG AA (4.5:1) for body text everywhere: widgets from the palette, the chat's
    bubbles, code (every token colour of the highlighting style), links and notes."""
    palette = theme.palette(chosen)
    for text, ground in (
        (Role.Text, Role.Base),  # chat view, composer, sidebar list
        (Role.WindowText, Role.Window),  # status bar, labels, toolbar
        (Role.ButtonText, Role.Button),
        (Role.PlaceholderText, Role.Base),
        (Role.HighlightedText, Role.Highlight),
        (Role.ToolTipText, Role.ToolTipBase),
        (Role.Link, Role.Base),
    ):
        assert contrast(palette.color(text), palette.color(ground)) >= 4.5, (text, ground)
    chat = chosen.chat
    assert contrast(chat.warning, palette.color(Role.Window)) >= 4.5  # the context warning
    for ground in (chat.user_bg, chat.assistant_bg, chat.code_bg):
        for colour in (chat.text, chat.muted, chat.link, chat.warning):
            assert contrast(colour, ground) >= 4.5, (colour, ground)
    for token, style in get_style_by_name(chat.code_style):
        if style["color"] and "Whitespace" not in str(token) and "Error" not in str(token):
            assert contrast(f"#{style['color']}", chat.code_bg) >= 4.5, token


@pytest.mark.parametrize("chosen", [theme.LIGHT, theme.DARK], ids=lambda t: t.name)
def test_the_focus_ring_shows_on_every_background(qapp, chosen):
    """WCAG 2.2 focus appearance: 3:1 against what is next to it. The ring's inner line
    is the base colour, for a selected row (on the highlight colour)."""
    palette = theme.palette(chosen)
    chat = chosen.chat
    grounds = [palette.color(Role.Base), palette.color(Role.Window)]
    for ground in [*grounds, chat.user_bg, chat.assistant_bg, chat.code_bg]:
        assert contrast(chat.focus, ground) >= 3, ground
    assert contrast(palette.color(Role.Base), palette.color(Role.Highlight)) >= 3


def ring_pixels(widget, colour: str) -> int:
    image = widget.grab().toImage()
    rgb = QColor(colour).rgb()
    return sum(
        image.pixel(x, y) == rgb for y in range(image.height()) for x in range(image.width())
    )


@pytest.mark.parametrize("name", ["light", "dark"])
def test_tab_into_the_sidebar_shows_where_the_focus_is(qtbot, name):
    theme.choose(name)
    ring = theme.controller().current.chat.focus
    box = QLineEdit()
    sidebar = Sidebar()
    holder = QWidget()
    column = QVBoxLayout(holder)
    column.addWidget(box)
    column.addWidget(sidebar)
    qtbot.addWidget(holder)
    holder.resize(300, 400)
    holder.show()
    entries = [SidebarEntry(i, f"Chat {i}", None, "2026-12-04T01:00:00") for i in (1, 2)]
    sidebar.show_conversations(entries, None)
    opened = []
    sidebar.conversation_selected.connect(opened.append)
    holder.activateWindow()
    qtbot.waitUntil(holder.isActiveWindow, timeout=5_000)
    box.setFocus()
    assert ring_pixels(sidebar.list, ring) == 0
    for _ in range(3):  # New chat, the search box, the list
        qtbot.keyClick(QApplication.focusWidget(), Qt.Key.Key_Tab)
    assert QApplication.focusWidget() is sidebar.list
    # A ring round the list and its row: far more than its edge's length.
    assert ring_pixels(sidebar.list, ring) > 2 * (sidebar.list.width() + sidebar.list.height())
    assert opened == []  # reaching the list opens no chat; Down does
    qtbot.keyClick(sidebar.list, Qt.Key.Key_Down)
    assert opened == [2] or opened == [1]


@pytest.mark.parametrize("name", ["light", "dark"])
def test_a_message_action_reached_by_tab_has_a_ring(qtbot, name):
    theme.choose(name)
    view = ChatView()
    qtbot.addWidget(view)
    view.resize(500, 300)
    view.show()
    theme.follow(view, name)
    view.show_messages([RenderedMessage(1, "user", "Hi"), RenderedMessage(2, "assistant", "Yo")])
    view.activateWindow()
    qtbot.waitUntil(view.isActiveWindow, timeout=5_000)
    view.setFocus()
    focused = ring_pixels(view, view.colours.focus)
    view.clearFocus()
    # Focus on the chat: a ring round it, two pixels wide.
    edge = 2 * (view.width() + view.height())
    assert focused - ring_pixels(view, view.colours.focus) >= 2 * edge - 16
    view.setFocus()
    before = ring_pixels(view.viewport(), view.colours.focus)
    view.focusNextPrevChild(True)  # what Tab does inside the chat: the first link
    assert view.textCursor().selectedText() == "Copy"
    link = view.focused_link_rect()
    assert link is not None
    after = ring_pixels(view.viewport(), view.colours.focus)
    assert after - before >= 2 * (link.width() + link.height())  # a ring all round it
    view.focusNextPrevChild(True)
    edit = view.focused_link_rect()
    view.focusNextPrevChild(True)  # the reply's Copy; Shift+Tab goes back to Edit
    view.focusNextPrevChild(False)
    assert view.textCursor().selectedText() == "Edit"
    assert edit is not None and view.focused_link_rect() == edit
