"""The status bar: where a reply's cache came from, its figures, progress for a slow
start, and messages that fit (Qt offscreen, the real starter model)."""

from __future__ import annotations

from dataclasses import replace

from gui_window import (
    READY_MS,
    prefer,
    send,
)

from app.engine.generation import TurnStats
from app.engine.turns import ReplyFinished, RestoreInfo
from app.ui.turn_status import TurnStatus, live_text


def test_reopening_after_a_restart_resumes_from_disk(qtbot, open_window):
    window = open_window()
    send(qtbot, window, "Tell me about the moon.")
    conversation = window.conversation_id
    window.close()

    reopened = open_window()
    finished = []
    reopened.engine.worker.finished.connect(finished.append)
    reopened.sidebar.list.setCurrentRow(0)
    assert reopened.conversation_id == conversation
    # Selecting it restores the cache at once, before anything is sent.
    qtbot.waitUntil(lambda: reopened.status.message.text().startswith("Ready: "), timeout=READY_MS)
    assert " tokens restored in " in reopened.status.message.text()
    send(qtbot, reopened, "And the sun?")
    assert finished[-1].restore.source == "memory"
    # Nothing stale stays up: the "Ready: …" of the restore is gone with the reply.
    assert reopened.status.message.text() == ""


def test_a_turn_that_reads_most_of_the_chat_again_does_not_say_continuing(qtbot, open_window):
    """Found on a new-user walk: after a new system prompt the status bar said
    "Continuing: 6 tokens already in memory" while 1,130 were read again."""
    window = open_window()
    send(qtbot, window, "Tell me about the moon. " * 20, greedy_tokens=8)
    changed = []
    window.engine.worker.changed.connect(changed.append)
    window.system_prompt_requested.emit(window.conversation_id, "Answer as a pirate would.")
    qtbot.waitUntil(lambda: bool(changed), timeout=10_000)
    send(qtbot, window, "And the sun?", greedy_tokens=4)
    text = window.status.message.text()
    # Said as the reply began, in the past (the walk saw "Reading…" while it streamed).
    assert text.startswith("Read the conversation again from where it changed"), text
    reused, _, total = text.split("(kept ")[1].split(" tokens")[0].partition(" of ")
    assert int(reused.replace(",", "")) * 2 < int(total.replace(",", ""))
    # A long new message reads more than the chat held, but the chat is not read again.
    send(qtbot, window, "Here is a long note to think about. " * 60, greedy_tokens=4)
    assert window.status.message.text() == ""


def test_a_slow_start_shows_a_busy_bar_until_text_arrives(qtbot, open_window):
    window = open_window()
    window.on_busy(True)
    window.turns.start()
    progress = window.status.progress
    qtbot.waitUntil(lambda: progress.isVisible(), timeout=5_000)  # after half a second
    assert progress.format() == "Preparing…" and progress.maximum() == 0
    window.status.on_first_text("Hello")
    assert not progress.isVisible()
    window.on_busy(False)


def test_a_long_prompts_bar_shows_its_whole_text(qtbot, open_window):
    """Found on a new-user walk: the status bar gave the bar its size hint, and
    "Reading 1,536/2,114 tokens" showed as "Reading 1,536/2,1"."""
    window = open_window()
    window.on_busy(True)
    window.turns.start()
    qtbot.wait(600)  # the bar shows for a start slower than half a second
    window.status.on_prompt_progress(1_536, 22_114)
    progress = window.status.progress
    qtbot.waitUntil(lambda: progress.isVisible(), timeout=5_000)
    shown = progress.text()
    assert shown == "Reading 1,536/22,114 tokens"
    assert progress.width() > progress.fontMetrics().horizontalAdvance(shown)
    window.on_busy(False)


def test_a_reply_stopped_before_its_first_token_gives_no_speed():
    """Found on a new-user walk: "first token 0 ms · 0.0 tok/s" for a reply stopped
    before it began."""
    from app.engine.generation import TurnStats
    from app.engine.turns import ReplyFinished, RestoreInfo
    from app.ui.turn_status import stats_text

    def reply(generated: int) -> ReplyFinished:
        stats = TurnStats(prompt_tokens=40, ttft_s=0.05, generated_tokens=generated, decode_s=0.5)
        return ReplyFinished("", stats, RestoreInfo(), 1, 2)

    assert stats_text(reply(0)).startswith("no reply yet · chat in memory: 40 tokens")
    assert stats_text(reply(10)).startswith("first token 50 ms · 20.0 tok/s · chat in memory: 50")


def test_times_near_a_tenth_of_a_second_are_said_one_way():
    """A new-user walk saw "first token 100 ms" after one reply and "0.10 s" after the
    next."""
    from app.ui.turn_status import took

    assert [took(s) for s in (0.0994, 0.0996, 0.1, 0.104)] == ["99 ms", *["0.10 s"] * 3]
    assert took(0.0004) == "0 ms" and took(2.345) == "2.35 s"


def test_the_status_bar_says_where_a_reply_started_in_words():
    """Found on new-user walks: "Continuing: 71 tokens already in memory" stayed up after
    the reply; "(6 of 595 tokens were in memory)" explained nothing."""
    from app.ui.turn_status import restore_text

    assert restore_text("memory", 71, 0.0, 80, 71) == "Continuing the chat: reading your message"
    assert restore_text("memory", 71, 0.0, 80, 71, read=True) == ""
    assert restore_text("memory", 6, 0.0, 595, 590, read=True) == (
        "Read the conversation again from where it changed (kept 6 of 595 tokens)"
    )
    assert restore_text("disk", 4096, 0.05, read=True) == (
        "Resumed from saved cache: 4,096 tokens in 50 ms"
    )


def test_a_long_status_message_ends_with_an_ellipsis_beside_whole_figures(qtbot):
    """Found on a new-user walk: a long error in the status bar was cut off mid-letter
    against the turn's figures."""
    from PySide6.QtWidgets import QMainWindow

    window = QMainWindow()
    qtbot.addWidget(window)
    status = TurnStatus(window.statusBar())
    window.resize(700, 300)
    window.show()
    figures = "first token 0.13 s · 39.0 tok/s · chat in memory: 2,757 tokens, 64.9 MB"
    status.stats.setText(figures)
    long = "trunc.gguf could not be read (damaged or truncated?): " + "tensor data " * 20
    status.say(long)
    # the figures whole, the message in the room left
    whole = lambda: status.stats.width() >= status.stats.sizeHint().width()  # noqa: E731
    qtbot.waitUntil(lambda: whole() and status.message.width() > 50, timeout=2_000)
    assert status.message.geometry().right() < status.stats.geometry().left()
    shown = status.message.shown_text()
    assert shown.endswith("…") and long.startswith(shown[:-1])
    assert status.message.text() == long and status.message.toolTip() == long
    status.say("Stopped")
    assert status.message.shown_text() == "Stopped"


def test_a_raced_turn_says_at_its_end_which_way_the_chat_came_back(qtbot):
    """A restore raced against rereading (app/engine/restore_race.py) starts as a reread;
    the bar says which got the chat in first once the reply is in."""
    from PySide6.QtWidgets import QMainWindow

    window = QMainWindow()
    qtbot.addWidget(window)
    status = TurnStatus(window.statusBar())
    racing = RestoreInfo(raced=True, prompt_tokens=720)
    status.on_restored(racing, first_turn=False)
    assert status.message.text() == "Reading the conversation from the start"
    restored = replace(racing, source="disk", tokens=700, seconds=0.2)
    status.on_finished(ReplyFinished("Paris.", TurnStats(finish_reason="stop"), restored, 1, 2))
    assert status.message.text() == "Resumed from saved cache: 700 tokens in 0.20 s"
    status.on_finished(ReplyFinished("Paris.", TurnStats(finish_reason="stop"), racing, 1, 3))
    assert status.message.text() == "Read the conversation from the start"


def test_the_live_count_says_one_token_not_one_tokens():
    assert live_text(1, 0.5) == "≈1 token · 2.0 tok/s"
    assert live_text(1_200, 0) == "≈1,200 tokens"


def test_a_kv_choice_changed_since_the_last_reply_is_said_beside_its_figures(qtbot, open_window):
    """New-user walk: after choosing 8-bit in Preferences the status bar still read the
    last reply's "Off (full precision)", as if the choice had not been taken."""
    window = open_window()
    send(qtbot, window, "Name a colour.", greedy_tokens=4)
    assert window.status.stats.text().endswith("· memory saving: Off (full precision)")
    saved = []
    window.engine.worker.preferences_saved.connect(saved.append)
    prefer(window, kv_bits=8)
    qtbot.waitUntil(lambda: bool(saved), timeout=10_000)
    said = window.status.stats.text()
    assert said.endswith("· memory saving: Off (full precision) · next reply: 8-bit")
    send(qtbot, window, "And another?", greedy_tokens=4)
    assert window.status.stats.text().endswith("· memory saving: 8-bit"), window.status.stats.text()
