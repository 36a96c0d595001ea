"""A chat's own system prompt and settings from the header, a new chat's before its
first message included (Qt offscreen, the real starter model)."""

from __future__ import annotations

import threading

from gui_window import (
    prefer,
    send,
    wait_reply,
    when_a_box_opens,
)
from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QApplication,
    QLabel,
    QMessageBox,
)

from app.ui.asking import PromptDialog


def test_a_chat_gets_its_own_system_prompt_from_the_header(qtbot, open_window):
    window = open_window()
    prefer(window, system_prompt="You are helpful.")
    qtbot.waitUntil(lambda: "(default)" in window.header.label.text(), timeout=5_000)
    send(qtbot, window, "Hi", greedy_tokens=4)

    def type_and_press_ok(dialog) -> None:  # as a user does: type, Tab to OK, Enter
        qtbot.keyClicks(dialog.text, "Answer in French.")
        qtbot.keyClick(dialog.text, Qt.Key.Key_Tab)
        qtbot.keyClick(QApplication.focusWidget(), Qt.Key.Key_Return)

    when_a_box_opens(type_and_press_ok, kind=PromptDialog)
    window.header.edit.click()
    qtbot.waitUntil(lambda: "(this chat)" in window.header.label.text(), timeout=5_000)
    assert "Answer in French." in window.header.label.text()
    assert window.store.get(window.conversation_id).system_prompt == "Answer in French."
    window.new_chat()
    assert "(default): “You are helpful.”" in window.header.label.text()


def test_after_the_system_prompt_dialog_typing_goes_to_the_message_box(qtbot, open_window):
    """A new user's walk: after OK, focus went back to the header's button, so the next
    word was lost and its space opened the dialog again; what followed went into the
    prompt, in front of the old one (the cursor started at its beginning)."""
    window = open_window()
    send(qtbot, window, "Hi", greedy_tokens=4)
    window.system_prompt_requested.emit(window.conversation_id, "Answer in French.")
    qtbot.waitUntil(lambda: "(this chat)" in window.header.label.text(), timeout=5_000)
    said = []

    def go_on_writing(dialog) -> None:
        said.append(dialog.findChild(QLabel).text())
        qtbot.keyClicks(dialog.text, " Briefly.")
        dialog.accept()

    when_a_box_opens(go_on_writing, kind=PromptDialog)
    qtbot.mouseClick(window.header.edit, Qt.MouseButton.LeftButton)  # as a user does
    # The window's focus (offscreen, the window may not be active again yet)
    assert window.focusWidget() is window.composer.edit
    qtbot.keyClicks(window.focusWidget(), "Where next?")
    assert window.composer.edit.toPlainText() == "Where next?"
    chat = lambda: window.store.get(window.conversation_id)  # noqa: E731
    qtbot.waitUntil(lambda: chat().system_prompt == "Answer in French. Briefly.", timeout=5_000)
    assert "left empty: the model's own" in said[0]  # the header's words for it


def test_a_new_chat_gets_its_own_prompt_and_settings_before_its_first_message(qtbot, open_window):
    """A new user's walk: System prompt… and Chat settings… were greyed out until a first
    message was sent, so a persona could not be set first."""
    from app.ui.chat_settings import ChatSettingsDialog

    window = open_window()
    assert window.conversation_id is None and window.header.edit.isEnabled()

    def write_prompt(dialog) -> None:
        dialog.text.setPlainText("Answer like a pirate.")
        dialog.accept()

    when_a_box_opens(write_prompt, kind=PromptDialog)
    window.header.edit.click()
    qtbot.waitUntil(lambda: window.conversation_id is not None, timeout=10_000)
    made = window.conversation_id
    qtbot.waitUntil(lambda: "(this chat)" in window.header.label.text(), timeout=5_000)
    assert window.store.get(made).system_prompt == "Answer like a pirate."
    assert window.sidebar.list.count() == 1  # the chat is there, as it was made
    # Said as it is (a walk read "reads the chat again when continued" of an empty chat).
    assert window.sidebar.list.item(0).text().endswith("· no messages yet")

    def cooler(dialog) -> None:
        dialog.boxes["temperature"].setValue(0.2)
        dialog.accept()

    when_a_box_opens(cooler, kind=ChatSettingsDialog)
    window.header.settings.click()
    qtbot.waitUntil(lambda: "Temperature 0.2" in window.header.label.text(), timeout=5_000)
    send(qtbot, window, "Hi", greedy_tokens=4)
    assert window.conversation_id == made and len(window.store.list()) == 1
    chat = window.store.get(made)
    assert [m.role for m in chat.messages] == ["user", "assistant"] and chat.title == "Hi"

    window.new_chat()  # a prompt dialog left empty, or Cancel, makes no chat
    when_a_box_opens(lambda dialog: dialog.reject(), kind=PromptDialog)
    window.header.edit.click()
    qtbot.wait(200)
    assert window.conversation_id is None and len(window.store.list()) == 1


def busy_worker(window, monkeypatch):
    """Keep the worker busy until the returned event is set (a slow disk, say): what the
    window asks for meanwhile waits behind it, in order."""

    from PySide6.QtCore import QObject, Signal

    from app.engine import found

    class Asks(QObject):
        find = Signal()

    held = threading.Event()
    monkeypatch.setattr(found, "discover", lambda **_: held.wait(10) and None)
    asks = Asks(window)
    asks.find.connect(window.engine.worker.find_models)
    asks.find.emit()
    return held


def test_a_new_chats_settings_and_a_message_sent_at_once_make_one_chat(
    qtbot, open_window, monkeypatch
):
    """Review: with the worker busy, a prompt set for a new chat and a message sent at
    once made two chats: the prompt's, empty, and the message's, without the prompt."""
    window = open_window()
    held = busy_worker(window, monkeypatch)
    when_a_box_opens(
        lambda d: (d.text.setPlainText("Answer like a pirate."), d.accept()), kind=PromptDialog
    )
    window.header.edit.click()
    prefer(window, temperature=0.0, max_tokens=4)
    window.composer.edit.setPlainText("Ahoy?")
    window.composer.edit.submitted.emit()
    assert window.status.message.text().startswith("Making this chat")
    held.set()
    qtbot.waitUntil(lambda: window.conversation_id is not None, timeout=10_000)
    wait_reply(qtbot, window)
    (chat,) = window.store.list()
    stored = window.store.get(chat.id)
    assert stored.system_prompt == "Answer like a pirate."
    assert [m.content for m in stored.messages[:1]] == ["Ahoy?"]


def test_a_chat_opened_while_a_new_one_is_made_stays_on_screen(qtbot, open_window, monkeypatch):
    """Review: going back to a chat before the worker had made the new one showed the new
    one's prompt over it, and its next message went to the new chat."""
    window = open_window()
    send(qtbot, window, "Name a fruit.", greedy_tokens=4)
    fruit = window.conversation_id
    window.new_chat()
    held = busy_worker(window, monkeypatch)
    when_a_box_opens(
        lambda d: (d.text.setPlainText("Answer like a pirate."), d.accept()), kind=PromptDialog
    )
    window.header.edit.click()
    window.show_conversation(fruit)  # as a click in the sidebar
    held.set()
    qtbot.waitUntil(lambda: window.sidebar.list.count() == 2, timeout=10_000)
    assert window.conversation_id == fruit and "pirate" not in window.header.label.text()
    send(qtbot, window, "And a vegetable?", greedy_tokens=4)
    assert window.conversation_id == fruit
    assert window.store.get(fruit).messages[2].content == "And a vegetable?"


def test_a_prompt_chosen_for_a_chat_deleted_meanwhile_goes_to_no_other_chat(
    qtbot, open_window, monkeypatch
):
    """A review: the chat deleted while its System prompt dialog was up made way for its
    neighbour, and the neighbour got the prompt."""
    window = open_window()
    kept, going, held = deleted_behind_a_busy_worker(qtbot, window, monkeypatch)
    assert window.conversation_id == kept  # the neighbour at once, not after the worker
    window.show_conversation(going)  # still listed: opened again, and its dialog

    def while_it_goes(dialog) -> None:
        held.set()
        qtbot.waitUntil(lambda: window.conversation_id != going, timeout=10_000)
        dialog.text.setPlainText("You are a pirate.")
        dialog.accept()

    when_a_box_opens(while_it_goes, kind=PromptDialog)
    window.header.edit.click()
    assert window.status.message.text() == "That chat was deleted meanwhile: nothing was changed"
    assert window.store.get(kept).system_prompt is None


def test_a_message_sent_to_a_chat_as_it_is_deleted_is_not_lost(qtbot, open_window, monkeypatch):
    """A review: the window went on showing the chat being deleted; a message sent to it
    failed, and the window switched to the neighbour without showing it, losing the text
    and the neighbour's draft."""
    window = open_window()
    kept, _, held = deleted_behind_a_busy_worker(qtbot, window, monkeypatch)
    qtbot.keyClicks(window.composer.edit, "typed after")
    assert window.conversation_id == kept and window.chat.messages[0].content == "Say hello."
    held.set()
    qtbot.waitUntil(lambda: window.sidebar.list.count() == 1, timeout=10_000)
    assert window.composer.edit.toPlainText() == "typed after"


def deleted_behind_a_busy_worker(qtbot, window, monkeypatch):
    """Two chats; the open one deleted (Yes) while the worker is busy, so the delete
    waits: (the chat kept, the one going, the event that frees the worker)."""
    send(qtbot, window, "Say hello.", greedy_tokens=4)
    kept = window.conversation_id
    window.new_chat()
    send(qtbot, window, "Say goodbye.", greedy_tokens=4)
    going = window.conversation_id
    held = busy_worker(window, monkeypatch)
    when_a_box_opens(lambda box: box.button(QMessageBox.StandardButton.Yes).click())
    window.actions.delete(going)
    return kept, going, held
