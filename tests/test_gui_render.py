"""The chat view draws a finished message once: a streaming reply redraws only itself."""

from __future__ import annotations

import mlx.core as mx
from PySide6.QtCore import QEvent, QObject
from PySide6.QtGui import QRegion
from PySide6.QtWidgets import QTextEdit

from app.bench.ui import stream_row
from app.ui.chat_view import ChatView
from app.ui.render import RenderedMessage


def conversation(count: int) -> list[RenderedMessage]:
    return [
        RenderedMessage(i, "user" if i % 2 else "assistant", f"Message {i}\n\n```py\nx = {i}\n```")
        for i in range(1, count + 1)
    ]


def test_streaming_redraws_only_the_last_message(qtbot, monkeypatch):
    view = ChatView()
    qtbot.addWidget(view)
    view.show_messages(conversation(50))
    view.append_streaming(RenderedMessage(-2, "assistant", "", state="streaming"))
    whole_redraws = []
    original = QTextEdit.setHtml
    monkeypatch.setattr(
        QTextEdit, "setHtml", lambda self, h: (whole_redraws.append(1), original(self, h))
    )
    for piece in ("Here ", "is **bold", "** text and `code`", " and more."):
        view.add_text(piece)
        qtbot.waitUntil(lambda: not view._refresh.isActive(), timeout=5_000)
    assert whole_redraws == []
    assert "Here is bold text and code and more." in view.toPlainText()

    fresh = ChatView()  # what a full drawing of the same messages shows
    qtbot.addWidget(fresh)
    fresh.show_messages(view.messages)
    assert view.toPlainText() == fresh.toPlainText()


def test_the_ui_bench_streams_into_the_real_window(qtbot):
    row = stream_row(10)
    assert row["messages"] == 11 and row["ticks"] > 100 and row["max_gap_ms"] >= 0


def line_with_mark(view: ChatView) -> str:
    [line] = [t for t in view.toPlainText().splitlines() if "▍" in t]
    return line.strip()


def test_the_streaming_mark_ends_the_last_line_of_text(qtbot):
    view = ChatView()
    qtbot.addWidget(view)
    reply = RenderedMessage(-2, "assistant", "", state="streaming")
    view.show_messages([RenderedMessage(1, "user", "Hi"), reply])
    assert line_with_mark(view) == "▍"  # nothing yet: the mark alone
    for text, last_line in (
        ("Hello there, friend", "Hello there, friend▍"),
        ("Two things:\n\n- one\n- two", "two▍"),
        ("Steps:\n\n1. first\n2. second", "second▍"),
        ("Code:\n\n```python\nx = 1\ny = 2", "y = 2▍"),  # a block still open
        ("Code:\n\n```python\nx = 1\n```", "x = 1▍"),
        ("<think>Let me see", "Let me see▍"),  # reasoning, no answer yet
    ):
        reply.content = text
        view.redraw_last()
        assert line_with_mark(view) == last_line, text
    reply.state = "complete"
    view.redraw_last()
    assert "▍" not in view.toPlainText()


def test_opening_a_reasoning_fold_keeps_the_reader_where_they_were(qtbot):
    """Found on a new-user walk: Show jumped the view to the conversation's end, so the
    reasoning it opened was out of sight."""
    from PySide6.QtCore import QUrl

    view = ChatView()
    qtbot.addWidget(view)
    view.resize(600, 300)
    view.show()
    long = "\n\n".join(f"Paragraph {i} of a long answer." for i in range(40))
    view.show_messages(
        [
            RenderedMessage(1, "user", "Think first."),
            RenderedMessage(2, "assistant", f"<think>Step one, step two.</think>{long}"),
            RenderedMessage(3, "user", "More?"),
            RenderedMessage(4, "assistant", long),
        ]
    )
    bar = view.verticalScrollBar()
    qtbot.waitUntil(lambda: bar.maximum() > 0 and bar.value() == bar.maximum(), timeout=5_000)
    reading = bar.maximum() // 3
    bar.setValue(reading)  # the reader went up, to the first answer
    assert "Step one" not in view.toPlainText()
    view.anchorClicked.emit(QUrl(f"action:{view._token}:think:2"))
    assert "Step one" in view.toPlainText()
    qtbot.wait(50)  # the rest of the layout, a part at a time
    assert bar.value() == reading


def test_think_tags_the_user_typed_are_shown_as_typed(qtbot):
    """Found on a new-user walk: a user's own "<think>…</think>" was taken out of its
    place and folded away as if it were the model's reasoning."""
    view = ChatView()
    qtbot.addWidget(view)
    typed = "Before <think>my own words</think> after"
    reply = RenderedMessage(2, "assistant", "<think>mine</think>Hi")
    view.show_messages([RenderedMessage(1, "user", typed), reply])
    text = view.toPlainText()
    assert typed in text
    assert text.count("Reasoning") == 1 and "mine" not in text  # the reply's stays folded


def test_a_reply_that_failed_says_so(qtbot):
    """Found on a new-user walk: a turn refused before its first token (a KV group size
    the model's heads cannot take) left an empty "Assistant" with nothing to say why."""
    view = ChatView()
    qtbot.addWidget(view)
    view.show_messages(
        [
            RenderedMessage(1, "user", "go on"),
            RenderedMessage(2, "assistant", "", "failed", is_last=True),
        ]
    )
    assert "No reply: this turn failed" in view.toPlainText()


def test_the_status_bar_names_the_bits_of_a_mixed_cache():
    """Found on a new-user walk: a chat of windows and recurrent states at 8 bits was
    reported "Off (full precision)" (the description's first part is the state's)."""
    from mlx_lm.models.cache import ArraysCache

    from app.engine.cache_keys import describe_cache
    from app.engine.kvquant import MixedKVCache
    from app.engine.kvscheme import scheme_for
    from app.ui.preferences import kv_label_of

    window = MixedKVCache(scheme_for(8, 32), max_size=64)
    window.update_and_fetch(*(mx.zeros((1, 1, 3, 32)) for _ in range(2)))
    state = ArraysCache(1)
    state[0] = mx.zeros((1, 4))
    described = describe_cache([state, window])
    assert described.startswith("float32 state") and "8-bit" in described
    assert kv_label_of(described) == "8-bit"
    assert kv_label_of(describe_cache([state])) == "Off (full precision)"


def test_what_the_user_typed_is_shown_as_typed(qtbot):
    """A new user's walk: their **bold** turned bold and the backticks round `code`
    went. A reply's Markdown is still formatted."""
    view = ChatView()
    qtbot.addWidget(view)
    typed = "Is **this** bold? Run `ls`.\n\n    indented  twice\n<b>tag</b>"
    view.show_messages(
        [RenderedMessage(1, "user", typed), RenderedMessage(2, "assistant", "**Yes**")]
    )
    text = view.toPlainText().replace("\u2028", "\n")
    assert typed in text
    assert "**Yes**" not in text and "Yes" in text


class PaintedRegions(QObject):
    """Records the region each paint of a widget covered."""

    def __init__(self) -> None:
        super().__init__()
        self.regions: list[QRegion] = []

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        if event.type() == QEvent.Type.Paint:
            self.regions.append(QRegion(event.region()))
        return False


def test_scrolling_with_the_focus_ring_leaves_no_copies_of_it(qtbot):
    """Qt scrolls a view by moving its pixels and painting the strip uncovered: the focus
    ring, drawn at the viewport's edge, was moved into the text as lines (a new-user walk
    saw them after scrolling with the wheel)."""
    view = ChatView()
    qtbot.addWidget(view)
    view.resize(500, 300)
    view.show_messages(conversation(30))
    view.show()
    qtbot.waitExposed(view)
    view.setFocus()
    qtbot.waitUntil(view.hasFocus)
    bar = view.verticalScrollBar()
    bar.setValue(bar.maximum() // 2)
    painted = PaintedRegions()
    view.viewport().installEventFilter(painted)
    qtbot.wait(50)
    painted.regions.clear()
    bar.setValue(bar.value() + 40)  # what a turn of the wheel does
    qtbot.waitUntil(lambda: bool(painted.regions), timeout=2_000)
    qtbot.wait(50)
    whole = view.viewport().rect()
    assert any((QRegion(whole) - r).isEmpty() for r in painted.regions)
