"""A chat's own settings at the top of the chat: the header says what differs from the
defaults and which model the chat was made with; the dialog edits them by keyboard."""

from __future__ import annotations

from gui_window import READY_MS, send, when_a_box_opens
from PySide6 import QtGui
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication

from app.service.preferences import Preferences
from app.ui.chat_header import ChatHeader
from app.ui.chat_settings import ChatSettingsDialog
from sessions import paths
from sessions.conversations import ConversationStore
from sessions.db import open_db
from sessions.overrides import KV_OFF, ChatOverrides


def stored_chat(model: str, overrides: ChatOverrides | None = None):
    store = ConversationStore(open_db())
    chat = store.create(model)
    store.set_overrides(chat.id, overrides or ChatOverrides())
    return store.get(chat.id)


def test_the_header_says_what_differs_from_the_defaults(qtbot):
    header = ChatHeader()
    qtbot.addWidget(header)
    prefs = Preferences(temperature=0.7, kv_bits=None)
    chat = stored_chat("qwen", ChatOverrides(temperature=0.2, top_p=0.95, kv_bits=8))
    header.show(chat, "qwen", prefs, ["qwen"])
    # top_p 0.95 is the default's value: nothing to say about it.
    assert header.label.text() == (
        "qwen · Temperature 0.2 · 8-bit memory saving · System prompt: the model's own"
    )
    assert header.notice.isHidden() and header.settings.isEnabled()
    header.show(chat, "qwen", Preferences(temperature=0.2, kv_bits=8), ["qwen"])
    assert header.label.text() == "qwen · System prompt: the model's own"  # the defaults caught up
    off = stored_chat("qwen", ChatOverrides(kv_bits=KV_OFF, max_tokens=200))
    header.show(off, "qwen", Preferences(kv_bits=4), ["qwen"])
    assert "Replies up to 200 tokens · Full precision (no memory saving)" in header.label.text()
    header.show(None, "qwen", prefs, ["qwen"], ready=False)
    assert not header.settings.isEnabled()  # a new chat, and no model loaded to make it with
    header.show(None, "qwen", prefs, ["qwen"])
    assert header.settings.isEnabled() and header.edit.isEnabled()  # set before it starts


def test_the_header_names_the_chats_own_model_and_offers_both_ways(qtbot):
    header = ChatHeader()
    qtbot.addWidget(header)
    chat = stored_chat("llama")
    header.show(chat, "qwen", Preferences(), ["qwen", "llama"])
    assert header.notice.text() == "This chat was made with llama; qwen is loaded now."
    assert not header.switch.isHidden() and header.switch.text() == "Switch to llama"
    with qtbot.waitSignal(header.switch_requested) as switched:
        header.switch.click()
    assert switched.args == ["llama"]
    with qtbot.waitSignal(header.keep_requested) as kept:
        header.keep.click()
    assert kept.args == ["qwen"]
    header.show(chat, "qwen", Preferences(), ["qwen"])  # llama was deleted
    assert "llama, which is no longer installed. It continues with qwen." in header.notice.text()
    assert header.switch.isHidden() and not header.keep.isHidden()
    header.show(chat, "llama", Preferences(), ["qwen", "llama"], ready=False)
    assert header.notice.isHidden()  # nothing to offer while a model loads


def dialog_with(qtbot, overrides: ChatOverrides):
    dialog = ChatSettingsDialog(None, overrides, Preferences())
    qtbot.addWidget(dialog)
    with qtbot.waitActive(dialog):
        dialog.show()
    qtbot.waitUntil(lambda: QApplication.focusWidget() is not None, timeout=5_000)
    return dialog


def test_the_dialog_is_used_by_keyboard(qtbot):
    dialog = dialog_with(qtbot, ChatOverrides())
    temperature = dialog.boxes["temperature"]
    assert temperature.text() == "Default: 0.7" and "adventurous" in temperature.toolTip()
    # Rich text, which Qt wraps: a plain tooltip ran off the dialog in one line (a walk).
    tips = [box.toolTip() for box in dialog.boxes.values()] + [dialog.kv_bits.toolTip()]
    assert all(QtGui.Qt.mightBeRichText(tip) for tip in tips)
    assert "“Default”" in temperature.toolTip()  # how to go back to it, in its words
    assert QApplication.focusWidget() is temperature
    temperature.lineEdit().selectAll()
    qtbot.keyClicks(temperature, "0.2")
    order = [QApplication.focusWidget()]
    for _ in range(5):
        qtbot.keyClick(QApplication.focusWidget(), Qt.Key.Key_Tab)
        order.append(QApplication.focusWidget())
    expected = [dialog.boxes[n] for n in dialog.boxes] + [dialog.kv_bits]
    assert order == expected
    qtbot.keyClick(dialog.kv_bits, Qt.Key.Key_Down)  # Default → Off (full precision)
    qtbot.keyClick(dialog.kv_bits, Qt.Key.Key_Down)  # → 8-bit
    qtbot.keyClick(QApplication.focusWidget(), Qt.Key.Key_Return)
    assert dialog.result() == ChatSettingsDialog.DialogCode.Accepted
    assert dialog.chosen == ChatOverrides(temperature=0.2, kv_bits=8)


def test_escape_cancels_and_use_defaults_resets(qtbot):
    dialog = dialog_with(qtbot, ChatOverrides(temperature=0.2, max_tokens=99, kv_bits=KV_OFF))
    assert dialog.boxes["max_tokens"].value() == 99
    assert dialog.kv_bits.currentText() == "Off (full precision)"
    qtbot.keyClick(QApplication.focusWidget(), Qt.Key.Key_Escape)
    assert dialog.result() == ChatSettingsDialog.DialogCode.Rejected and dialog.chosen is None

    dialog = dialog_with(qtbot, ChatOverrides(temperature=0.2, max_tokens=99, kv_bits=KV_OFF))
    dialog.reset_button.click()
    assert dialog.boxes["max_tokens"].text() == "Default: 1024"
    qtbot.keyClick(
        QApplication.focusWidget(), Qt.Key.Key_Return, Qt.KeyboardModifier.ControlModifier
    )
    assert dialog.chosen == ChatOverrides()


def test_chat_settings_from_the_header_reach_the_next_turn(qtbot, open_window):
    window = open_window()
    send(qtbot, window, "Say hello.", greedy_tokens=20)
    assert window.header.settings.isEnabled()

    def set_by_keyboard(dialog) -> None:
        box = dialog.boxes["max_tokens"]
        box.setFocus()
        box.lineEdit().selectAll()
        qtbot.keyClicks(box, "3")
        qtbot.keyClick(box, Qt.Key.Key_Tab)
        qtbot.keyClick(dialog.kv_bits, Qt.Key.Key_End)  # 4-bit
        qtbot.keyClick(dialog.kv_bits, Qt.Key.Key_Return)

    when_a_box_opens(set_by_keyboard, kind=ChatSettingsDialog)
    window.header.settings.click()
    qtbot.waitUntil(lambda: "4-bit memory saving" in window.header.label.text(), timeout=5_000)
    assert "Replies up to 3 tokens" in window.header.label.text()
    chat = window.conversation_id
    assert window.store.get(chat).overrides == ChatOverrides(max_tokens=3, kv_bits=4)
    # `send` sets the default reply length to 20; this chat's own 3 wins.
    send(qtbot, window, "Say goodbye.", greedy_tokens=20)
    last = window.store.get(chat).messages[-1]
    assert last.stats["generated_tokens"] <= 3
    assert last.stats["kv_format"].startswith("4-bit")
    assert window.status.stats.text().endswith("MB · memory saving: 4-bit")


def test_a_chat_of_another_model_offers_to_switch_to_it(qtbot, open_window, tiny_model_dir):
    (paths.models_dir() / "tiny").symlink_to(tiny_model_dir)
    window = open_window()
    starter = window.models.current()
    chat = stored_chat("tiny")
    window.refresh_sidebar()
    window.show_conversation(chat.id)
    assert window.header.notice.text() == f"This chat was made with tiny; {starter} is loaded now."
    window.header.switch.click()
    qtbot.waitUntil(
        lambda: window.models.ready and window.models.current() == "tiny", timeout=READY_MS
    )
    assert window.header.notice.isHidden()

    gone = stored_chat("a-deleted-model")
    window.show_conversation(gone.id)
    assert "no longer installed" in window.header.notice.text()
    assert window.header.switch.isHidden()
    window.header.keep.click()
    qtbot.waitUntil(lambda: window.store.get(gone.id).model == "tiny", timeout=5_000)
    qtbot.waitUntil(window.header.notice.isHidden, timeout=5_000)

    # Sending without a choice goes on with the loaded model too: it is the chat's now.
    other = stored_chat("another-deleted-model")
    window.show_conversation(other.id)
    assert not window.header.notice.isHidden()
    send(qtbot, window, "Hello", greedy_tokens=3)
    assert window.store.get(other.id).model == "tiny"
    assert window.header.notice.isHidden()
