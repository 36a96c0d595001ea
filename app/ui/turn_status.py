"""The status bar's account of a turn: where the cache came from, a progress bar
for a slow start, and the finished reply's speed and memory."""

from __future__ import annotations

from typing import TYPE_CHECKING

from PySide6.QtCore import QElapsedTimer, QObject, QSize, Qt, QTimer, Slot
from PySide6.QtGui import QPainter
from PySide6.QtWidgets import QLabel, QProgressBar, QStatusBar

from app.ui.preferences import kv_label_of

if TYPE_CHECKING:  # the engine is imported on the worker's thread, after the first paint
    from app.engine.turns import CacheSaved, ReplyFinished, RestoreInfo


# Show a progress bar only for prefill or restore that takes longer than this.
PROGRESS_AFTER_MS = 500
# The live count while a reply streams is redrawn at most this often.
LIVE_FIGURES_MS = 250


def live_text(pieces: int, seconds: float) -> str:
    """The streaming reply's figures. A piece is one streamed text segment, one token
    nearly always (a multi-byte character can take two), hence the "≈"."""
    rate = f" · {pieces / seconds:.1f} tok/s" if seconds > 0 else ""
    return f"≈{pieces:,} {'token' if pieces == 1 else 'tokens'}{rate}"


def took(seconds: float) -> str:
    """Under a tenth of a second in milliseconds, else in seconds; decided on the figure
    shown (0.0996 s read "100 ms" beside another turn's "0.10 s")."""
    milliseconds = round(seconds * 1000)
    return f"{milliseconds} ms" if milliseconds < 100 else f"{seconds:.2f} s"


def progress_text(done: int, total: int) -> str:
    return f"Reading {done:,}/{total:,} tokens"


def restore_text(
    source: str,
    tokens: int,
    seconds: float,
    prompt_tokens: int = 0,
    held_tokens: int = 0,
    read: bool = False,
) -> str:
    """Where the turn's cache came from, in the user's words. Most of the prompt read
    again because the chat changed (a changed system prompt, an edit near the start:
    memory kept less than it held) is not "continuing", whatever was in memory; a long
    new message is. `read`: the reply has begun, so what was being read has been (a
    new-user walk saw "Reading…" stay up while the reply streamed). A chat that simply
    goes on has nothing to say once its reply begins (a walk saw "Continuing: 71 tokens
    already in memory" stay up after the reply, and read it as jargon)."""
    if source == "disk":
        return f"Resumed from saved cache: {tokens:,} tokens in {took(seconds)}"
    if source == "memory" and prompt_tokens > 2 * tokens and tokens < held_tokens:
        # Not "near the start": a branch chosen at the second message is not (a walk).
        kept = f"kept {tokens:,} of {prompt_tokens:,} tokens"
        if read:
            return f"Read the conversation again from where it changed ({kept})"
        return f"Reading the conversation again from where it changed ({kept})"
    if source == "memory":
        return "" if read else "Continuing the chat: reading your message"
    return (
        "Read the conversation from the start"
        if read
        else "Reading the conversation from the start"
    )


def not_restored_text(why: str) -> str:
    """A selected chat whose saved state cannot be used: its next reply will take a
    while, in the sidebar's words ("resumes by rereading"); the engine's reason, unless
    it is only that nothing was saved (a walk read "no saved cache" as jargon)."""
    if why == "no saved cache":
        return "Nothing saved to resume this chat: its next reply rereads it"
    return f"Can't resume this chat at once ({why}): its next reply rereads it"


def stats_text(reply: ReplyFinished) -> str:
    """The turn's speed (how soon its first token came, then tokens a second: a reopened
    chat's first token is what the app is for) and what its cache holds. Not called
    "context": the meter under the composer says how much of the context the chat takes
    (it counts the chat as the next turn renders it, a few framing tokens more than the
    cache holds)."""
    stats = reply.stats
    cached = stats.prompt_tokens + stats.generated_tokens
    kind = kv_label_of(stats.kv_format)  # the Preferences' words; the details in a tooltip
    # Stopped before its first token: no speed to give (it read "first token 0 ms").
    speed = (
        f"first token {took(stats.ttft_s)} · {stats.decode_tps:.1f} tok/s"
        if stats.generated_tokens
        else "no reply yet"
    )
    # "memory saving: …" (a new user's walk read a bare "Off (full precision)" as nothing,
    # and "in memory 71 tokens" as jargon)
    held = f"chat in memory: {cached:,} tokens, {stats.kv_bytes / 1e6:.1f} MB"
    return f"{speed} · {held} · memory saving: {kind}"


class CutLabel(QLabel):
    """A one-line label that ends its text with "…" where the room runs out, the whole
    text in its tooltip: a long message beside the turn's figures was cut off mid-letter
    (a new-user walk). `text()` stays the whole text."""

    def __init__(self) -> None:
        super().__init__("")

    def setText(self, text: str) -> None:
        super().setText(text)
        self.setToolTip(text)

    def minimumSizeHint(self) -> QSize:  # it gives way to the figures, not they to it
        return QSize(1, super().minimumSizeHint().height())

    def sizeHint(self) -> QSize:
        return QSize(1, super().sizeHint().height())

    def shown_text(self) -> str:
        """What fits of the text, as painted."""
        cut = Qt.TextElideMode.ElideRight
        return self.fontMetrics().elidedText(self.text(), cut, self.contentsRect().width())

    def paintEvent(self, _event) -> None:
        QPainter(self).drawText(self.contentsRect(), int(self.alignment()), self.shown_text())


class TurnStatus(QObject):
    def __init__(self, status_bar: QStatusBar) -> None:
        super().__init__(status_bar)
        self.message = CutLabel()
        self.stats = QLabel("")
        self.progress = QProgressBar()
        # Wide enough for its longest text: in a status bar it is given its size hint,
        # which cut "Reading 1,536/2,114 tokens" to "Reading 1,536/2,1" (a new-user walk).
        widest = self.progress.fontMetrics().horizontalAdvance(progress_text(888_888, 888_888))
        self.progress.setFixedWidth(widest + 3 * self.progress.fontMetrics().averageCharWidth())
        self.progress.hide()
        status_bar.addWidget(self.message, 1)
        status_bar.addPermanentWidget(self.progress)
        status_bar.addPermanentWidget(self.stats)
        self.busy = False
        self._until_done = ""  # a message about the turn under way (`say_while_busy`)
        self._clock = QElapsedTimer()
        self._decode_clock = QElapsedTimer()  # from the first streamed text
        self._pieces = 0
        self._drawn_at = 0
        # Restoring a cache reports no steps: a busy bar if the reply is slow to start.
        self._slow_start = QTimer(self, singleShot=True, interval=PROGRESS_AFTER_MS)
        self._slow_start.timeout.connect(self.on_slow_start)
        self._figures = ("", "")  # the last reply's, and the KV choice its cache was in
        self._chosen = ""  # the chat's KV choice for its next reply (`next_kv`)
        self._changed_kv = ""  # that choice, where it changed since the last reply
        # What the bar says of the turn's cache until the reply begins, and then
        # (`on_first_text`); ("", "") once said, or on a chat's first turn.
        self._restore_said: tuple[str, str] = ("", "")

    def begin(self) -> None:
        self._clock.start()
        self._slow_start.start()
        self.message.setText("Thinking…")
        self.clear_figures()

    def say(self, text: str) -> None:
        self.message.setText(text)

    def unsay(self, text: str) -> None:
        """No more `text`, if it is what the bar says (it no longer holds)."""
        if self.message.text() == text:
            self.message.setText("")

    def say_while_busy(self, text: str) -> None:
        """`text` until the turn under way ends (it speaks of that turn)."""
        self.message.setText(text)
        self._until_done = text

    def next_kv(self, label: str) -> None:
        """The KV choice the chat's next reply uses. Changed since the last reply, it is
        said beside that reply's figures until the next one ends (a new-user walk read the
        last reply's "Off (full precision)" as if the change to 8-bit had not been taken;
        a model whose cache cannot be quantized keeps its own label after the next reply)."""
        changed = self._chosen not in ("", label)
        self._chosen = label
        if changed:
            self._changed_kv = label
            self._show_figures()

    def _show_figures(self) -> None:
        figures, kind = self._figures
        if figures and self._changed_kv not in ("", kind):
            figures += f" · next reply: {self._changed_kv}"
        self.stats.setText(figures)

    def clear_figures(self) -> None:
        """No figures from another turn or another chat stay on screen."""
        self._figures = ("", "")
        self.stats.setText("")
        self.stats.setToolTip("")
        self._pieces = 0
        self._drawn_at = 0
        self._decode_clock.invalidate()

    @Slot(str)
    def on_text(self, _text: str) -> None:
        """Count the streaming reply and show its figures, a few times a second."""
        if not self._decode_clock.isValid():
            self._decode_clock.start()
        self._pieces += 1
        elapsed = self._decode_clock.elapsed()
        if self._pieces == 1 or elapsed - self._drawn_at >= LIVE_FIGURES_MS:
            self._drawn_at = elapsed
            self.stats.setText(live_text(self._pieces, elapsed / 1000))

    @Slot(bool)
    def on_busy(self, busy: bool) -> None:
        self.busy = busy
        if not busy:
            self._slow_start.stop()
            self.progress.hide()
            self.unsay(self._until_done)
            self._until_done = ""

    @Slot()
    def on_slow_start(self) -> None:
        if self.busy and not self.progress.isVisible():
            self.progress.setRange(0, 0)  # busy, no steps
            self.progress.setFormat("Preparing…")
            self.progress.show()

    @Slot(str)
    def on_first_text(self, _text: str) -> None:
        if self._slow_start.isActive() or self.progress.maximum() == 0:
            self._slow_start.stop()
            self.progress.hide()
        before, after = self._restore_said
        if before and self.message.text() == before:
            self.message.setText(after)
        self._restore_said = ("", "")

    @Slot(int, int)
    def on_prompt_progress(self, done: int, total: int) -> None:
        if done >= total:
            self.progress.hide()
            return
        if self._clock.isValid() and self._clock.elapsed() > PROGRESS_AFTER_MS:
            self.progress.setRange(0, total)
            self.progress.setValue(done)
            self.progress.setFormat(progress_text(done, total))
            self.progress.show()

    def on_restored(self, info: RestoreInfo, first_turn: bool) -> None:
        said = (info.source, info.tokens, info.seconds, info.prompt_tokens, info.held_tokens)
        if first_turn:
            self._restore_said = ("", "")
        else:
            self._restore_said = (restore_text(*said), restore_text(*said, read=True))
        self.message.setText(self._restore_said[0])

    def on_prefetched(self, info: RestoreInfo, has_messages: bool = True) -> None:
        """The selected chat's cache is in memory: its next reply starts at once; or it
        could not be restored, and its next reply will take a while."""
        if info.source == "disk":
            self.message.setText(f"Ready: {info.tokens:,} tokens restored in {took(info.seconds)}")
        elif info.rejected and has_messages:  # a wait is coming: say so now, not after Send
            self.message.setText(not_restored_text(info.rejected))

    def on_finished(self, reply: ReplyFinished) -> None:
        self.progress.hide()
        self._figures = (stats_text(reply), kv_label_of(reply.stats.kv_format))
        self._changed_kv = ""
        self._show_figures()
        self.stats.setToolTip(f"KV cache as stored in memory: {reply.stats.kv_format}")
        if reply.stats.finish_reason == "cancelled":
            self.message.setText("Stopped")
        elif reply.restore.raced:  # which of the two got the chat in first is known now
            info = reply.restore
            self.message.setText(restore_text(info.source, info.tokens, info.seconds, read=True))

    def on_saved(self, saved: CacheSaved) -> None:
        if saved.error:
            self.message.setText(f"The cache was not saved: {saved.error}")

    @Slot(str)
    def on_exported(self, path: str) -> None:
        self.message.setText(f"Exported to {path}")

    def on_failed(self, message: str) -> None:
        self.progress.hide()
        self.message.setText(message.splitlines()[0])
