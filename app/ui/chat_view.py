"""The conversation, rendered as HTML; the app's own links in it are actions (copy, edit, ...).

What a message shows is untrusted (app/ui/render.py renders it as text). The view also
holds the line itself: it loads no resource at all (the app's HTML needs none), acts only on
links that carry its own secret token, and hands a message's http(s) links to the system
browser on a click, never navigating itself.
"""

from __future__ import annotations

import secrets
import time

from PySide6.QtCore import QRect, QTimer, QUrl, Signal, Slot
from PySide6.QtGui import (
    QColor,
    QCursor,
    QDesktopServices,
    QGuiApplication,
    QImage,
    QKeyEvent,
    QPainter,
    QPaintEvent,
    QShowEvent,
    QTextCursor,
    QTextDocument,
)
from PySide6.QtWidgets import QTextBrowser, QToolTip, QWidget

from app.ui.render import (
    LIGHT_CHAT,
    START,
    ChatColours,
    RenderedMessage,
    code_blocks,
    conversation_html,
    is_web_url,
    link_style,
    message_html,
    reasoning_and_answer,
)
from app.ui.theme import draw_ring
from app.ui.typing_to import pass_letters

# Re-render a streaming reply at most this often: smooth, and cheap for the event loop.
_STREAM_REFRESH_MS = 60
_IMAGE_RESOURCE = QTextDocument.ResourceType.ImageResource.value


class ChatView(QTextBrowser):
    action = Signal(str, int)  # verb, message id ("edit", "regenerate", "branch-prev", ...)

    def __init__(self) -> None:
        super().__init__()
        self.setOpenLinks(False)
        self.setOpenExternalLinks(False)
        self.setObjectName("chatView")
        self.anchorClicked.connect(self._on_link)
        # Tab moves the focus from link to link: draw its ring again, all of it.
        self.cursorPositionChanged.connect(self.viewport().update)
        self.highlighted.connect(self._show_link_target)
        self.messages: list[RenderedMessage] = []
        self.empty_text = START
        self.refused_resources = 0  # loads the document asked for, all refused
        # The app's links carry this; a message cannot know it, so cannot forge them.
        self._token = secrets.token_hex(16)
        self._thinking_open: set[int] = set()
        self.editing: int | None = None  # the message the box holds for an edit
        self._refresh = QTimer(self, singleShot=True, interval=_STREAM_REFRESH_MS)
        self._refresh.timeout.connect(self.redraw_last)
        self._tail_start: int | None = None  # where the last message begins in the document
        self.colours = LIGHT_CHAT
        self.document().setDefaultStyleSheet(link_style(self.colours))
        self.type_into: QWidget | None = None  # where letters typed here go (`keyPressEvent`)
        self._pinned = True  # the view shows the conversation's end (`_keep_pinned`)
        self.verticalScrollBar().valueChanged.connect(self._note_pinned)
        self.verticalScrollBar().rangeChanged.connect(self._keep_pinned)

    @Slot(object)
    def set_colours(self, colours: ChatColours) -> None:
        """Draw the conversation again in a theme's colours: the finished messages are
        only drawn once per `render`, so a new theme needs a whole render."""
        if colours == self.colours:
            return
        self.colours = colours
        self.document().setDefaultStyleSheet(link_style(colours))
        self._render_in_place()

    def _render_in_place(self) -> None:
        """Draw the conversation again where the reader is, not at its end."""
        bar = self.verticalScrollBar()
        position = bar.value()
        self.render()
        bar.setValue(position)

    @Slot(object)
    def mark_editing(self, message_id: int | None) -> None:
        """Mark the message the message box holds for an edit (None: no edit)."""
        if message_id != self.editing:
            self.editing = message_id
            self._render_in_place()

    def set_empty_text(self, text: str) -> None:
        """What an empty chat says (render.START, or how to add a model first)."""
        if text != self.empty_text:
            self.empty_text = text
            if not self.messages:
                self.render()

    def show_messages(self, messages: list[RenderedMessage]) -> None:
        self.messages = messages
        self.render(scroll_to_end=True)

    def update_messages(self, messages: list[RenderedMessage]) -> None:
        """The same conversation, changed (a reply finished): a reader at its end stays
        at its end, one reading further up stays where they are."""
        self.messages = messages
        if self._pinned:
            self.render(scroll_to_end=True)
        else:
            self._render_in_place()

    def append_streaming(self, message: RenderedMessage) -> None:
        """Add a message at the end; only the one before it is drawn again (it stops
        being the last), not the whole conversation."""
        if self._tail_start is None or not self.messages:
            self.messages.append(message)
            self.render(scroll_to_end=True)
            return
        self.redraw_last()  # the old last message, final now
        self.messages.append(message)
        self._tail_start = self._end()
        self.redraw_last(scroll_to_end=True)

    @Slot(str)
    def add_text(self, delta: str) -> None:
        """Extend the streaming reply; the view catches up on a short timer."""
        if self.messages:
            self.messages[-1].content += delta
            if not self._refresh.isActive():
                self._refresh.start()

    def render(self, scroll_to_end: bool = False) -> None:
        """Draw the whole conversation: the finished messages once, then the last one
        apart, so a streaming reply redraws only itself (`redraw_last`)."""
        for m in self.messages:
            m.show_thinking = m.id in self._thinking_open
            m.being_edited = m.id == self.editing
        if not self.messages:
            self._tail_start = None
            self.setHtml(conversation_html([], self._token, self.colours, self.empty_text))
            return
        self.setHtml(
            "".join(message_html(m, self._token, self.colours) for m in self.messages[:-1])
        )
        self._tail_start = self._end() if len(self.messages) > 1 else 0
        self.redraw_last(scroll_to_end)

    def _end(self) -> int:
        return self.document().characterCount() - 1

    @Slot()
    def redraw_last(self, scroll_to_end: bool = False) -> None:
        """Replace the last message's part of the document with its current HTML."""
        if self._tail_start is None or not self.messages:
            self.render(scroll_to_end)
            return
        started = time.perf_counter()
        bar = self.verticalScrollBar()
        at_end = scroll_to_end or bar.value() >= bar.maximum() - 4
        position = bar.value()
        last = self.messages[-1]
        last.show_thinking = last.id in self._thinking_open
        last.being_edited = last.id == self.editing
        cursor = QTextCursor(self.document())
        cursor.beginEditBlock()
        cursor.setPosition(self._tail_start)
        cursor.movePosition(QTextCursor.MoveOperation.End, QTextCursor.MoveMode.KeepAnchor)
        cursor.removeSelectedText()
        cursor.insertHtml(message_html(last, self._token, self.colours))
        cursor.endEditBlock()
        bar.setValue(bar.maximum() if at_end else position)
        # However long a redraw takes (a huge reply), the event loop keeps twice that time
        # between two refreshes of a streaming reply.
        spent_ms = int((time.perf_counter() - started) * 1000)
        self._refresh.setInterval(max(_STREAM_REFRESH_MS, 2 * spent_ms))

    @Slot(int)
    def _note_pinned(self, value: int) -> None:
        self._pinned = value >= self.verticalScrollBar().maximum() - 4

    @Slot(int, int)
    def _keep_pinned(self, _minimum: int, maximum: int) -> None:
        """A conversation read at its end stays at its end as its text is laid out, which
        Qt does a part at a time, and when the view changes size (a new-user walk found
        a chat shown as the window opened at its top)."""
        if self._pinned:
            self.verticalScrollBar().setValue(maximum)

    def keyPressEvent(self, event: QKeyEvent) -> None:
        """Letters typed here go into the message box (`typing_to`)."""
        if not pass_letters(event, self.type_into):
            super().keyPressEvent(event)

    def showEvent(self, event: QShowEvent) -> None:
        """Qt scrolls to the text cursor (the conversation's start) when the view is first
        shown: a conversation shown at its end stays there."""
        pinned = self._pinned
        super().showEvent(event)
        if pinned:
            self.verticalScrollBar().setValue(self.verticalScrollBar().maximum())

    def paintEvent(self, event: QPaintEvent) -> None:
        """The text, then, with the keyboard focus, a ring at the edge and one around
        the link that has it (Qt's own mark is a dotted outline of one pixel)."""
        super().paintEvent(event)
        if not self.hasFocus():
            return
        painter = QPainter(self.viewport())
        ring = QColor(self.colours.focus)
        # The frame's ring is one pixel wide here (the text covers the rest): one more.
        draw_ring(painter, self.viewport().rect(), ring, None, width=1)
        link = self.focused_link_rect()
        if link is not None:
            draw_ring(painter, link, ring, None)
        painter.end()

    def scrollContentsBy(self, dx: int, dy: int) -> None:
        """Qt scrolls by moving the pixels on screen and painting the strip uncovered:
        with the focus, the ring at the edge would be moved into the text. All of it is
        painted again instead."""
        super().scrollContentsBy(dx, dy)
        if self.hasFocus():
            self.viewport().update()

    def focused_link_rect(self) -> QRect | None:
        """Where the link that Tab moved to is, on screen; None when there is none."""
        cursor = self.textCursor()
        if not self.hasFocus() or not cursor.hasSelection():
            return None
        start, end = QTextCursor(cursor), QTextCursor(cursor)
        start.setPosition(cursor.selectionStart())
        end.setPosition(cursor.selectionEnd())
        if not end.charFormat().isAnchor():  # the format of the last character selected
            return None
        first, last = self.cursorRect(start), self.cursorRect(end)
        if first.top() != last.top():  # a link cut over two lines: no ring
            return None
        return QRect(
            first.left(), first.top(), last.left() - first.left(), first.height()
        ).adjusted(-4, -2, 4, 2)

    def loadResource(self, kind: int, name: QUrl) -> QImage | str:
        """Refuse every resource: the app's HTML uses none, so a request came from a message.

        An empty value, not None: on None, QTextDocument reads local files and data: URLs
        itself.
        """
        self.refused_resources += 1
        return QImage() if kind == _IMAGE_RESOURCE else ""

    def _message(self, message_id: int) -> RenderedMessage | None:
        return next((m for m in self.messages if m.id == message_id), None)

    def _on_link(self, url: QUrl) -> None:
        target = url.toString()
        own = f"action:{self._token}:"
        if target.startswith(own):
            self._run_action(*target[len(own) :].split(":"))
        elif is_web_url(target):
            QDesktopServices.openUrl(url)
        # Anything else (another scheme, an action link without the token) does nothing.

    def _run_action(self, verb: str, arg: str, extra: str = "") -> None:
        message_id = int(arg)
        message = self._message(message_id)
        if verb == "copy-msg" and message:
            QGuiApplication.clipboard().setText(reasoning_and_answer(message)[1])
        elif verb == "copy-code" and message:
            section, _, number = extra.partition(".")
            thinking, answer = reasoning_and_answer(message)
            blocks = code_blocks((thinking if section == "think" else answer) or "")
            if number.isdigit() and int(number) < len(blocks):
                QGuiApplication.clipboard().setText(blocks[int(number)])
        elif verb == "think":  # the fold opens or closes below its link, in view
            self._thinking_open ^= {message_id}
            self._render_in_place()
        else:
            self.action.emit(verb, message_id)

    def _show_link_target(self, url: QUrl) -> None:
        """Hovering a message's link shows where it really goes, whatever its text says."""
        if is_web_url(url.toString()):
            QToolTip.showText(QCursor.pos(), url.toString(), self)
        else:
            QToolTip.hideText()
