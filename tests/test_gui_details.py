"""Smaller things a user notices: one word for the KV setting, code that does not widen
the transcript, branch arrows one can hit, export names any system accepts."""

from __future__ import annotations

import json
import re

import pytest
from gui_window import prefer, send

from app.ui.chat_view import ChatView
from app.ui.preferences import PreferencesDialog
from app.ui.reading import export_name
from app.ui.render import RenderedMessage


def test_the_status_bar_names_the_kv_setting_as_preferences_do(qtbot, open_window):
    window = open_window()
    send(qtbot, window, "Say hello.", greedy_tokens=6)
    dialog = PreferencesDialog(window.preferences(), 0)
    qtbot.addWidget(dialog)
    chosen = dialog.kv_bits.currentText()
    assert window.status.stats.text().endswith(f"MB · memory saving: {chosen}")
    prefer(window, kv_bits=8)
    send(qtbot, window, "Say goodbye.", greedy_tokens=6)
    assert window.status.stats.text().endswith("MB · memory saving: 8-bit")


def test_a_long_code_line_does_not_scroll_the_transcript_sideways(qtbot):
    view = ChatView()
    qtbot.addWidget(view)
    view.resize(600, 400)
    view.show()
    line = "x = [" + ", ".join(str(i) for i in range(400)) + "]"
    view.show_messages([RenderedMessage(1, "assistant", f"```python\n{line}\n```")])
    qtbot.waitUntil(lambda: view.document().size().width() > 0, timeout=5_000)
    assert view.horizontalScrollBar().maximum() == 0
    assert "Copy" in view.toPlainText()


@pytest.mark.parametrize(
    ("branch", "links"),
    [((1, 2), ["Next"]), ((2, 3), ["Previous", "Next"]), ((3, 3), ["Previous"])],
)
def test_branch_arrows_are_words_and_stop_at_either_end(qtbot, branch, links):
    """Words, not 5-pixel glyphs; no link past the first or the last branch (new-user
    walk: Next on the last went round to the first)."""
    view = ChatView()
    qtbot.addWidget(view)
    view.show_messages([RenderedMessage(1, "assistant", "Hi", branch=branch, is_last=True)])
    shown = " ".join(view.toPlainText().replace("\xa0", " ").split())
    assert f"◀ Previous {branch[0]}/{branch[1]} Next ▶" in shown
    html = view.toHtml()
    assert [w for w in ("Previous", "Next") if f"branch-{w[:4].lower()}" in html] == links


def test_export_names_are_safe_file_names():
    assert export_name('What is 1/2? "Half": a <tiny> story|end*') == (
        "What is 1 2 Half a tiny story end"
    )
    assert export_name("../../etc/passwd") == "etc passwd"
    assert export_name("?\n\t") == "chat"
    assert export_name("List three fruits.") == "List three fruits"  # not "fruits..md"
    assert len(export_name("word " * 100)) <= 80


def test_the_two_cache_sizes_say_which_is_which(qtbot, open_window):
    window = open_window()
    send(qtbot, window, "Say hello.", greedy_tokens=6)
    assert "chat in memory: " in window.status.stats.text()
    assert re.match(r"first token \d+ ms|first token \d+\.\d\d s", window.status.stats.text())
    assert "KV" not in window.status.stats.text()
    # One number is called the context: the meter's (the cache holds a few tokens fewer).
    assert "context" not in window.status.stats.text().lower()
    qtbot.waitUntil(lambda: window.meter.label.text().startswith("Context: "), timeout=60_000)
    item = lambda: window.sidebar.list.item(0).text()  # noqa: E731
    saved = lambda: item().endswith("resumes at once")  # noqa: E731
    qtbot.waitUntil(saved, timeout=60_000)
    assert "cache" not in item() and "token" not in item()
    # The saved size, on hover, says it is the disk's (beside "chat in memory").
    assert window.sidebar.list.item(0).toolTip().endswith(" MB on disk")


def test_a_line_end_in_a_reply_is_a_line_end_on_screen(qtbot):
    """A poem or an address keeps its lines (CommonMark would join them)."""
    view = ChatView()
    qtbot.addWidget(view)
    view.show_messages([RenderedMessage(1, "assistant", "Roses are red,\nViolets are blue.")])
    lines = view.toPlainText().replace("\u2028", "\n").splitlines()
    assert "Roses are red," in lines and "Violets are blue." in lines


def test_a_message_longer_than_the_context_is_not_offered_a_new_chat(qtbot):
    from app.service.chat import ContextUse
    from app.ui.context_meter import ContextMeter

    meter = ContextMeter()
    qtbot.addWidget(meter)
    meter.show_use(ContextUse(3, "x", conversation=500, draft=9000, limit=8192))
    assert "the message alone is 9,000 tokens" in meter.label.text()
    assert "new chat" not in meter.label.text() and not meter.fresh.isVisibleTo(meter)
    meter.show_use(ContextUse(3, "x", conversation=8000, draft=300, limit=8192))
    assert meter.label.text().endswith("or send it in a new chat.")


def test_an_export_says_where_it_went_in_the_format_asked(
    qtbot, open_window, tmp_path, monkeypatch
):
    """The dialog offers the formats written, not "All Files" (a new-user walk), the one
    asked for first; a name ending in the other's suffix is written as that (a walk saved
    Markdown as "penguin.json")."""
    from PySide6.QtWidgets import QFileDialog

    answers = iter(
        [
            (tmp_path / "chat.md", "Markdown (*.md)"),
            (tmp_path / "chat.json", "JSON (*.json)"),
            (tmp_path / "typed.json", "Markdown (*.md)"),
        ]
    )
    offered = []

    def ask(parent, title, start, kinds, first):
        offered.append((kinds, first))
        path, chosen = next(answers)
        return str(path), chosen

    monkeypatch.setattr(QFileDialog, "getSaveFileName", ask)
    window = open_window()
    send(qtbot, window, "Say hello.", greedy_tokens=4)
    for target in ("chat.md", "chat.json", "typed.json"):
        window.actions.export(window.conversation_id, "markdown")  # what Ctrl+E does
        said = f"Exported to {tmp_path / target}"
        qtbot.waitUntil(lambda said=said: window.status.message.text() == said)
    assert "Say hello." in (tmp_path / "chat.md").read_text()
    for name in ("chat.json", "typed.json"):
        exported = json.loads((tmp_path / name).read_text())
        assert "Say hello." in json.dumps(exported)
    assert offered[0] == ("Markdown (*.md);;JSON (*.json)", "Markdown (*.md)")


def test_the_smallest_window_still_shows_the_header_and_some_chat(qtbot, open_window):
    """Found on a new-user walk: at the smallest size the window allowed (584x300) the
    chat header was clipped and the chat 50 px tall."""
    window = open_window()
    send(qtbot, window, "Say hello.", greedy_tokens=4)
    window.resize(100, 100)  # as small as it goes
    qtbot.waitUntil(lambda: window.width() < 1000, timeout=2_000)
    assert window.header.height() >= window.header.minimumSizeHint().height()
    assert window.chat.height() >= 150
