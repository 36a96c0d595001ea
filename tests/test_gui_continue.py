"""A reply cut by the length limit is marked and goes on with Continue; the status bar's
figures are the streaming reply's own, and go when the view changes."""

from __future__ import annotations

from gui_window import (
    READY_MS,
    prefer,
    send,
    wait_reply,
    wait_streaming,
)

from app.ui.render import action_href


def continue_link(window, message_id: int) -> str:
    return action_href(window.chat._token, "continue", message_id)


def test_a_cut_reply_is_marked_and_continues_in_place(qtbot, open_window):
    window = open_window()
    send(qtbot, window, "Write a long story about a lighthouse keeper.", greedy_tokens=6)
    cut = window.chat.messages[-1]
    assert window.store.message(cut.id).stats["finish_reason"] == "length"
    assert "Cut at the length limit" in window.chat.toPlainText()
    assert continue_link(window, cut.id) in window.chat.toHtml()
    before = cut.content

    prefer(window, temperature=0.0, max_tokens=12)
    with qtbot.waitSignal(window.engine.worker.finished, timeout=READY_MS):
        window.turns.on_chat_action("continue", cut.id)
    wait_reply(qtbot, window)
    stored = window.store.get(window.conversation_id).messages
    assert [m.role for m in stored] == ["user", "assistant"]  # the same reply, longer
    assert stored[-1].id == cut.id
    assert stored[-1].content.startswith(before) and len(stored[-1].content) > len(before)
    assert stored[-1].state == "complete"
    assert window.chat.messages[-1].content == stored[-1].content


def test_a_stopped_reply_can_be_continued_or_regenerated(qtbot, open_window):
    window = open_window()
    prefer(window, temperature=0.0, max_tokens=2000)  # greedy: the same long story each run
    window.composer.edit.setPlainText("Write a long story about a lighthouse keeper.")
    window.composer.edit.submitted.emit()
    wait_streaming(qtbot, window)
    window.composer.button.click()  # Stop
    wait_reply(qtbot, window)
    stopped = window.chat.messages[-1]
    assert stopped.state == "cancelled"
    html = window.chat.toHtml()
    assert continue_link(window, stopped.id) in html
    assert action_href(window.chat._token, "regenerate", 0) in html


def test_the_status_bar_counts_the_streaming_reply(qtbot, open_window):
    window = open_window()
    send(qtbot, window, "Say hello.", greedy_tokens=8)
    assert "tok/s" in window.status.stats.text()  # the finished turn's figures
    shown = []
    window.engine.worker.text_delta.connect(lambda _t: shown.append(window.status.stats.text()))
    prefer(window, temperature=0.0, max_tokens=40)
    window.composer.edit.setPlainText("Describe a forest.")
    window.composer.edit.submitted.emit()
    assert window.status.stats.text() == ""  # not the previous turn's
    wait_reply(qtbot, window)
    assert any(text.startswith("≈") and "tokens" in text for text in shown)

    window.new_chat()
    assert window.status.stats.text() == ""
    assert window.sidebar.list.selectedItems() == []
