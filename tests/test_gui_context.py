"""The context meter: the chat and the draft in tokens against the model's context, and a
message that will not fit is stopped before it is sent, with a way forward."""

from __future__ import annotations

from test_gui import READY_MS, library, open_window, prefer, send  # noqa: F401

WORDS = " ".join(f"word{i}" for i in range(12))  # about 40 tokens


def wait_meter(qtbot, window, draft: str):
    """Until the meter shows the count of this draft in this chat."""
    qtbot.waitUntil(
        lambda: (
            window.meter.use is not None
            and window.meter.use.draft_text == draft
            and window.meter.use.conversation_id == window.conversation_id
        ),
        timeout=READY_MS,
    )
    return window.meter.use


def test_the_meter_counts_the_chat_and_the_draft(qtbot, open_window):  # noqa: F811
    window = open_window()
    send(qtbot, window, "Say hello.", greedy_tokens=8)
    window.composer.edit.setPlainText(WORDS)
    use = wait_meter(qtbot, window, WORDS)
    assert use.conversation > 0 and use.draft > 10 and use.fits
    assert window.meter.label.text() == (
        f"Context: {use.conversation:,} tokens + {use.draft:,} in the draft of {use.limit:,}"
    )


def test_a_message_too_long_for_a_new_chat_is_not_sent(qtbot, open_window):  # noqa: F811
    window = open_window()
    prefer(window, max_context=16)
    long = " ".join([WORDS] * 3)
    window.composer.edit.setPlainText(long)
    use = wait_meter(qtbot, window, long)
    assert not use.fits and use.limit == 16
    assert window.meter.label.text().startswith("Too long to send")
    window.composer.edit.submitted.emit()  # Enter
    assert window.chat.messages == [] and window.conversation_id is None
    assert window.composer.edit.toPlainText() == long  # nothing lost
    assert not window.meter.fresh.isVisible()  # a new chat would not help


def test_a_message_that_overflows_the_chat_goes_to_a_new_one(qtbot, open_window):  # noqa: F811
    window = open_window()
    send(qtbot, window, "Say hello.", greedy_tokens=16)
    first = window.conversation_id
    window.composer.edit.setPlainText(WORDS)
    use = wait_meter(qtbot, window, WORDS)
    # A context the chat nearly fills, the draft alone does not.
    prefer(window, max_context=use.conversation + use.draft // 2, max_tokens=8)
    window.composer.edit.setPlainText(WORDS + " ")
    use = wait_meter(qtbot, window, WORDS + " ")
    assert not use.fits
    assert window.meter.fresh.isVisible()
    window.meter.fresh.click()  # "Send in a new chat"
    qtbot.waitUntil(
        lambda: window.conversation_id not in (None, first) and not window.generating,
        timeout=READY_MS,
    )
    qtbot.waitUntil(lambda: window.chat.messages[-1].id > 0, timeout=READY_MS)
    assert window.chat.messages[0].content == WORDS
    assert len(window.store.get(first).messages) == 2  # the first chat as it was
