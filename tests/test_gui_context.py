"""The context meter: the chat and the draft in tokens against the model's context, and a
message that will not fit is stopped before it is sent, with a way forward."""

from __future__ import annotations

from gui_window import (
    READY_MS,
    prefer,
    send,
    start_long_reply,
)

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


def test_the_meter_counts_the_chat_and_the_draft(qtbot, open_window):
    window = open_window()
    send(qtbot, window, "Say hello.", greedy_tokens=8)
    window.composer.edit.setPlainText(WORDS)
    use = wait_meter(qtbot, window, WORDS)
    assert use.conversation > 0 and use.draft > 10 and use.fits
    used, with_draft = f"{use.conversation:,} of {use.limit:,}", use.conversation + use.draft
    assert window.meter.label.text() == (
        f"Context: {used} tokens used, {with_draft:,} with your message"
    )
    assert "three quarters of a word" in window.meter.label.toolTip()


def test_a_message_too_long_for_a_new_chat_is_not_sent(qtbot, open_window):
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


def test_a_nearly_full_chat_says_so_before_it_overflows(qtbot, open_window):
    window = open_window()
    send(qtbot, window, "Say hello.", greedy_tokens=8)
    window.composer.edit.setPlainText(WORDS)
    use = wait_meter(qtbot, window, WORDS)
    assert "Nearly full" not in window.meter.label.text()
    prefer(window, max_context=int((use.conversation + use.draft) / 0.95))
    window.composer.edit.setPlainText(WORDS + " ")
    use = wait_meter(qtbot, window, WORDS + " ")
    assert use.fits
    assert "Nearly full: a long reply may be cut" in window.meter.label.text()


def test_a_message_that_overflows_the_chat_goes_to_a_new_one(qtbot, open_window):
    window = open_window()
    send(qtbot, window, "Say hello.", greedy_tokens=16)
    first = window.conversation_id
    window.new_chat()
    window.composer.edit.setPlainText("an idea for a new chat")
    window.show_conversation(first)  # typed in a new chat, then left for now
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
    # Neither draft went with it: the first chat has none, a new chat has its own.
    window.new_chat()
    assert window.composer.edit.toPlainText() == "an idea for a new chat"
    window.show_conversation(first)
    assert window.composer.edit.toPlainText() == ""


def test_while_editing_the_meter_counts_the_chat_before_the_edited_message(
    qtbot,
    open_window,
):
    window = open_window()
    send(qtbot, window, "Say hello.", greedy_tokens=8)
    window.composer.edit.setPlainText(WORDS)
    first_exchange = wait_meter(qtbot, window, WORDS)
    window.composer.edit.clear()
    send(qtbot, window, "Now say goodbye, at some length please.", greedy_tokens=24)
    second_question = window.chat.messages[2].id
    window.turns.on_chat_action("edit", second_question)
    window.composer.edit.setPlainText(WORDS)
    qtbot.waitUntil(
        lambda: window.meter.use is not None and window.meter.use.before == second_question,
        timeout=READY_MS,
    )
    use = window.meter.use
    # The edited message and its reply are not counted: the draft takes their place.
    assert (use.conversation, use.draft) == (first_exchange.conversation, first_exchange.draft)
    assert window.meter.label.text().startswith(f"Context: {use.conversation:,} of ")
    assert window.meter.label.text().endswith(" with your message")
    window.composer.cancel_edit()  # the whole chat counts again
    qtbot.waitUntil(
        lambda: window.meter.use.before is None and window.meter.use.draft_text == "",
        timeout=READY_MS,
    )
    assert window.meter.use.conversation > first_exchange.conversation + first_exchange.draft


def test_an_edit_that_will_not_fit_stays_in_the_composer(qtbot, open_window):
    window = open_window()
    send(qtbot, window, "Say hello.", greedy_tokens=8)
    question = window.chat.messages[0].id
    before = [m.content for m in window.chat.messages]
    prefer(window, max_context=24)
    long = " ".join([WORDS] * 3)
    window.turns.on_chat_action("edit", question)
    window.composer.edit.setPlainText(long)
    qtbot.waitUntil(
        lambda: (
            window.meter.use is not None
            and (window.meter.use.before, window.meter.use.draft_text) == (question, long)
        ),
        timeout=READY_MS,
    )
    assert window.meter.label.text().startswith("Too long to send")
    window.composer.edit.submitted.emit()  # Enter
    assert [m.content for m in window.chat.messages] == before  # the chat as it was
    assert window.composer.editing == question  # still editing that message
    assert window.composer.edit.toPlainText() == long  # nothing lost
    assert not window.generating


def live_count(window) -> int | None:
    text = window.meter.label.text()
    if "≈" not in text:
        return None
    return int(text.split("≈")[1].split()[0].replace(",", ""))


def test_the_meter_counts_a_streaming_reply_as_it_comes(qtbot, open_window):
    window = open_window()
    start_long_reply(qtbot, window)
    qtbot.waitUntil(lambda: live_count(window) is not None, timeout=READY_MS)
    first = live_count(window)
    assert "with the reply so far" in window.meter.label.text()
    qtbot.waitUntil(lambda: live_count(window) > first + 5, timeout=READY_MS)
    window.composer.button.click()  # Stop
    qtbot.waitUntil(lambda: not window.generating, timeout=READY_MS)
    use = wait_meter(qtbot, window, "")
    last = window.store.get(window.conversation_id).messages[-1]
    # Finished: the exact count, the whole reply in it.
    assert (
        window.meter.label.text() == f"Context: {use.conversation:,} of {use.limit:,} tokens used"
    )
    assert use.conversation >= first + last.stats["generated_tokens"] - 5
