"""Turns the engine refuses or that fail: the chat is drawn as saved, and a message or
edit it did not keep comes back where it was written, never a message it did keep;
failures that are not a turn's touch neither (new-user walk and reviews, 7 December)."""

from __future__ import annotations

from gui_window import READY_MS, boxes_said, prefer, send, wait_reply, when_a_box_opens
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QMessageBox


def test_a_message_the_worker_refuses_goes_back_into_the_message_box(
    qtbot, open_window, monkeypatch
):
    """Sent before the meter had counted it, a message too long for the context is
    refused by the worker, unsaved: it is not lost, it waits in the box again."""
    warned = boxes_said(monkeypatch)
    window = open_window()
    send(qtbot, window, "Name a colour.", greedy_tokens=4)
    prefer(window, max_context=64)
    long = "Tell me everything about every colour you know. " * 20
    window.composer.edit.setPlainText(long)
    window.composer.edit.submitted.emit()  # at once: the meter has not counted it
    qtbot.waitUntil(lambda: bool(warned) and not window.generating, timeout=READY_MS)
    assert "does not fit" in warned[0]
    assert window.composer.edit.toPlainText() == long.strip()
    assert [m.content for m in window.chat.messages if m.role == "user"] == ["Name a colour."]


def test_a_refused_edit_comes_back_as_the_edit_it_was_and_the_draft_waits(
    qtbot, open_window, monkeypatch
):
    boxes_said(monkeypatch)
    window = open_window()
    send(qtbot, window, "Name a colour.", greedy_tokens=4)
    first = window.chat.messages[0].id
    prefer(window, max_context=64)
    window.composer.edit.setPlainText("a draft")
    window.turns.on_chat_action("edit", first)
    long = "Name every colour you know, and say why. " * 20
    window.composer.edit.setPlainText(long)
    window.composer.edit.submitted.emit()  # at once: the meter has not counted it
    qtbot.waitUntil(lambda: not window.generating and window.composer.editing, timeout=READY_MS)
    assert window.composer.editing == first and window.composer.edit.toPlainText() == long.strip()
    qtbot.keyClick(window.composer.edit, Qt.Key.Key_Escape)
    assert window.composer.edit.toPlainText() == "a draft"


def test_a_failure_that_is_not_a_turns_puts_no_text_anywhere(qtbot, open_window, tmp_path):
    """Review: a failed export after a sent message put that message, long saved, into a
    new chat's empty box; and one queued just before a turn took that turn's text."""
    window = open_window()
    send(qtbot, window, "Name a colour.", greedy_tokens=4)
    sent = window.conversation_id
    window.new_chat()
    boxes = []
    window.engine.worker.failed.connect(boxes.append)
    when_a_box_opens(lambda box: box.accept(), kind=QMessageBox)
    window.export_requested.emit(sent, "markdown", str(tmp_path / "no" / "such" / "x.md"))
    qtbot.waitUntil(lambda: bool(boxes), timeout=10_000)
    qtbot.wait(200)
    assert window.composer.edit.toPlainText() == ""
    window.show_conversation(sent)
    when_a_box_opens(lambda box: box.accept(), kind=QMessageBox)
    window.export_requested.emit(sent, "markdown", str(tmp_path / "no" / "such" / "y.md"))
    window.composer.edit.setPlainText("Name another colour.")
    window.composer.edit.submitted.emit()
    wait_reply(qtbot, window)
    assert window.composer.edit.toPlainText() == ""
    users = [m.content for m in window.chat.messages if m.role == "user"]
    assert users == ["Name a colour.", "Name another colour."]


def test_an_empty_chat_opened_says_nothing_of_a_cache(qtbot, open_window, monkeypatch):
    """Review: a new chat whose first message was refused is left without messages; opened
    again it said "Not restored (no saved cache)", for a chat with nothing to read."""
    boxes_said(monkeypatch)
    window = open_window()
    send(qtbot, window, "Name a colour.", greedy_tokens=4)
    other = window.conversation_id
    window.new_chat()
    prefer(window, max_context=64)
    window.composer.edit.setPlainText("Name every colour you know, and say why. " * 20)
    window.composer.edit.submitted.emit()
    qtbot.waitUntil(
        lambda: not window.generating and window.conversation_id is not None, timeout=READY_MS
    )
    empty = window.conversation_id
    assert window.store.get(empty).messages == []
    window.show_conversation(other)
    window.show_conversation(empty)
    qtbot.wait(500)  # the restore asked for on selection has answered
    assert not window.status.message.text().startswith(("Nothing saved", "Can't resume"))


def test_a_refused_message_comes_back_whatever_branch_the_view_shows(
    qtbot, open_window, monkeypatch
):
    """Review: whether the chat kept a refused message was judged by counting the user's
    messages on screen, and a branch switch still queued when it was sent changed the
    count: the message was taken as saved, and lost. The database says now."""
    said = boxes_said(monkeypatch)
    window = open_window()
    for text in ("Name a colour.", "Name another.", "And one more."):
        send(qtbot, window, text, greedy_tokens=4)
    window.turns.on_chat_action("edit", window.chat.messages[0].id)
    window.composer.edit.setPlainText("Name a fruit.")
    window.composer.edit.submitted.emit()
    wait_reply(qtbot, window)  # a short branch on screen, a longer one beside it
    prefer(window, max_context=256)
    window.turns.on_chat_action("branch-prev", window.chat.messages[0].id)
    long = "Name every colour you know, and say why. " * 40
    window.composer.edit.setPlainText(long)
    window.composer.edit.submitted.emit()  # before the switch is on screen
    qtbot.waitUntil(lambda: bool(said) and not window.generating, timeout=READY_MS)
    assert window.composer.edit.toPlainText() == long.strip()
