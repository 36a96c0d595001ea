"""The window, driven as a user would, on the real starter model (Qt offscreen)."""

from __future__ import annotations

import itertools
import json
import threading
import time

import pytest
from gui_window import (
    READY_MS,
    prefer,
    send,
    start_long_reply,
    wait_reply,
    wait_streaming,
    when_a_box_opens,
)
from PySide6.QtCore import QByteArray, QMimeData, Qt, QTimer
from PySide6.QtWidgets import (
    QApplication,
    QLabel,
    QListWidget,
    QMessageBox,
    QProgressBar,
    QPushButton,
    QTextEdit,
    QWidget,
)

from app.service.preferences import Preferences
from app.ui.asking import PromptDialog
from app.ui.chat_view import ChatView
from app.ui.main_window import MainWindow
from app.ui.model_flow import ModelFlow
from app.ui.preferences import KV_FIGURES, PreferencesDialog, kv_tradeoffs
from app.ui.setting_words import FIELDS
from app.ui.turn_status import TurnStatus, live_text
from sessions.db import open_db
from sessions.settings import Settings


def test_send_streams_a_reply_and_stores_it(qtbot, open_window):
    window = open_window()
    assert not window.models.loading_action.isVisible()  # the loading bar went when ready
    # Plain words on the bar; how the model runs is there for who asks (the tooltip).
    assert window.models.state.text() == "Ready"
    assert window.models.state.toolTip().startswith("Running on cpu")
    deltas = []
    window.engine.worker.text_delta.connect(deltas.append)
    send(qtbot, window, "What is the capital of France?")
    assert len(deltas) > 1
    assert "Paris" in window.chat.toPlainText()
    roles = [m.role for m in window.chat.messages]
    assert roles == ["user", "assistant"]
    assert window.sidebar.list.count() == 1
    assert "tok/s" in window.status.stats.text()


def test_stop_ends_the_reply_early(qtbot, open_window):
    window = open_window()
    start_long_reply(qtbot, window)
    assert window.composer.button.text() == "Stop"
    window.composer.button.click()
    qtbot.waitUntil(lambda: not window.generating, timeout=READY_MS)
    last = window.store.get(window.conversation_id).messages[-1]
    assert last.state == "cancelled"
    assert last.stats["generated_tokens"] < 2000
    assert window.composer.button.text() == "Send"


def test_a_click_on_another_chat_while_replying_is_explained_until_the_reply_ends(
    qtbot, open_window
):
    """Found on a new-user walk: "A reply is being written here: stop it (Esc) to switch
    chats" stayed in the status bar after the reply had ended."""
    window = open_window()
    send(qtbot, window, "Name a colour.", greedy_tokens=4)
    first = window.conversation_id
    window.new_chat()
    prefer(window, temperature=0.0, max_tokens=48)
    window.composer.edit.setPlainText("Write a story about a lighthouse keeper.")
    window.composer.edit.submitted.emit()
    wait_streaming(qtbot, window, chars=5)
    assert window.models.state.text() == "Writing a reply…"  # a walk: it said "Ready"
    window.sidebar.conversation_selected.emit(first)
    assert window.status.message.text().startswith("A reply is being written here")
    assert window.conversation_id != first  # the reply's chat stays on screen
    wait_reply(qtbot, window)  # it ends by itself
    assert not window.status.message.text().startswith("A reply is being written here")
    assert window.models.state.text() == "Ready"


def test_after_a_click_on_stop_the_message_box_has_the_keyboard(qtbot, open_window):
    window = open_window()
    window.activateWindow()
    start_long_reply(qtbot, window)
    qtbot.mouseClick(window.composer.button, Qt.MouseButton.LeftButton)  # Stop
    qtbot.waitUntil(lambda: not window.generating, timeout=READY_MS)
    qtbot.waitUntil(lambda: QApplication.focusWidget() is window.composer.edit, timeout=2_000)


def test_regenerate_and_edit_make_branches(qtbot, open_window, monkeypatch):
    window = open_window()
    send(qtbot, window, "Name a colour.")
    first_reply = window.chat.messages[-1].id
    prefer(window, temperature=1.0)
    window.turns.on_chat_action("regenerate", 0)
    # While the new reply streams, the question shows once (the old reply's place redrawn).
    assert window.chat.toPlainText().count("Name a colour.") == 1
    wait_reply(qtbot, window)
    assert window.chat.messages[-1].branch == (2, 2)
    assert "2/2" in window.chat.toPlainText()
    window.turns.on_chat_action("branch-prev", window.chat.messages[-1].id)
    qtbot.waitUntil(lambda: window.chat.messages[-1].id == first_reply, timeout=5_000)

    user = window.chat.messages[0].id
    # Edit puts the message in the composer, in place of the draft the user was typing.
    window.composer.edit.setPlainText("a draft")
    window.turns.on_chat_action("edit", user)
    assert window.composer.edit.toPlainText() == "Name a colour."
    assert window.composer.banner.isVisibleTo(window) and window.composer.button.text() == "Send"
    window.composer.edit.setPlainText("Name a fruit.")
    window.composer.edit.submitted.emit()  # what Enter does
    streaming = window.chat.toPlainText()
    assert "Name a colour." not in streaming and streaming.count("Name a fruit.") == 1
    wait_reply(qtbot, window)
    assert window.chat.messages[0].content == "Name a fruit."
    assert window.chat.messages[0].branch == (2, 2)
    assert window.composer.edit.toPlainText() == "a draft"  # the draft is back
    assert not window.composer.banner.isVisibleTo(window)


def test_esc_leaves_an_edit_and_gives_the_draft_back(qtbot, open_window):
    window = open_window()
    send(qtbot, window, "Name a colour.", greedy_tokens=4)
    window.composer.edit.setPlainText("half a thought")
    window.turns.on_chat_action("edit", window.chat.messages[0].id)
    qtbot.keyClick(window.composer.edit, Qt.Key.Key_Escape)
    assert window.composer.edit.toPlainText() == "half a thought"
    qtbot.keyClicks(window.composer.edit, ", finished")  # the cursor waits at its end
    assert window.composer.edit.toPlainText() == "half a thought, finished"
    assert window.composer.editing is None and window.composer.button.text() == "Send"
    assert len(window.store.get(window.conversation_id).messages) == 2  # nothing was sent


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
    assert text.startswith("Read the conversation again: it changed near the start"), text
    reused, _, total = text.split("(kept ")[1].split(" tokens")[0].partition(" of ")
    assert int(reused.replace(",", "")) * 2 < int(total.replace(",", ""))
    # A long new message reads more than the chat held, but the chat is not read again.
    send(qtbot, window, "Here is a long note to think about. " * 60, greedy_tokens=4)
    assert window.status.message.text() == ""


def test_a_newer_selection_skips_the_restore_of_the_one_before(qtbot, open_window):
    window = open_window()
    prefetched = []
    window.engine.worker.prefetched.connect(lambda cid, info: prefetched.append(cid))
    window.engine.worker.select(2)
    window.engine.worker.prefetch(1)  # queued before the user moved on to chat 2
    qtbot.wait(200)
    assert prefetched == []


def test_search_filters_the_conversation_list(qtbot, open_window):
    window = open_window()
    send(qtbot, window, "Tell me about penguins.", greedy_tokens=8)
    window.new_chat()
    send(qtbot, window, "Tell me about volcanoes.", greedy_tokens=8)
    assert window.sidebar.list.count() == 2
    window.sidebar.search.setText("penguins")
    assert window.sidebar.list.count() == 1
    assert window.sidebar.list.item(0).text().startswith("Tell me about penguins.")
    window.sidebar.search.clear()
    assert window.sidebar.list.count() == 2


def test_preferences_persist(qtbot, open_window):
    window = open_window()
    dialog = PreferencesDialog(window.preferences(), 0)
    qtbot.addWidget(dialog)
    dialog.temperature.setValue(0.3)
    dialog.kv_bits.setCurrentIndex(1)  # 8-bit
    dialog.max_tokens.setValue(333)
    dialog.max_context.setValue(4096)
    dialog.accept()
    saved = []
    window.engine.worker.preferences_saved.connect(saved.append)
    window.ask_to_save(dialog.chosen)
    qtbot.waitUntil(lambda: bool(saved), timeout=5_000)
    again = Preferences.load(Settings(open_db()))  # as the next start reads them
    assert (again.temperature, again.kv_bits, again.max_tokens, again.max_context) == (
        0.3,
        8,
        333,
        4096,
    )
    reopened = PreferencesDialog(again, 0)
    qtbot.addWidget(reopened)
    assert reopened.kv_bits.currentText() == "8-bit"
    reopened.kv_bits.setCurrentIndex(2)
    assert "cannot be used" in reopened.kv_warning.text()


def test_clearing_caches_shows_the_space_it_freed(qtbot, open_window):
    """Found on a new-user walk: after Clear caches the Storage tab still showed the
    size from when it opened, and each chat said "nothing saved yet", as if its
    messages were not."""
    from app.ui.menus import preferences_dialog

    window = open_window()
    send(qtbot, window, "Tell me about owls.", greedy_tokens=4)
    other = window.conversation_id
    window.new_chat()
    send(qtbot, window, "Tell me about penguins.", greedy_tokens=4)
    qtbot.waitUntil(lambda: window.index.usage()[1] > 0, timeout=10_000)
    dialog = preferences_dialog(window)
    qtbot.addWidget(dialog)
    assert not dialog.usage_label.text().startswith("0.0 MB")
    clear = next(b for b in dialog.findChildren(QPushButton) if b.text() == "Clear caches")
    qtbot.mouseClick(clear, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: dialog.usage_label.text().startswith("0.0 MB"), timeout=10_000)
    window.refresh_sidebar()
    assert "resumes by rereading" in window.sidebar.list.item(0).text()
    # A chat opened now has nothing to restore: it says so before Send, not after a wait.
    window.sidebar.conversation_selected.emit(other)
    qtbot.waitUntil(lambda: window.status.message.text().startswith("Not restored"), timeout=10_000)
    assert "no saved cache" in window.status.message.text()


def test_open_cache_folder_opens_the_folder_in_use_or_says_where_it_is(
    qtbot, app_dirs, monkeypatch
):
    """Found on a new-user walk: on a desktop without a file launcher the button did
    nothing and said nothing (and it opened the folder above the one "In use" names).
    The launcher is the desktop's: faked here, answering as it would."""
    from PySide6.QtGui import QDesktopServices

    from sessions import paths

    (paths.cache_dir() / "kv").mkdir(parents=True)
    asked, answer = [], [True]
    monkeypatch.setattr(
        QDesktopServices, "openUrl", lambda url: asked.append(url.toLocalFile()) or answer[0]
    )
    dialog = PreferencesDialog(Preferences(), 0)
    qtbot.addWidget(dialog)
    button = next(b for b in dialog.findChildren(QPushButton) if b.text() == "Open cache folder")
    qtbot.mouseClick(button, Qt.MouseButton.LeftButton)
    assert asked == [str(paths.cache_dir() / "kv")]
    assert "No file manager" not in dialog.usage_label.text()
    answer[0] = False  # no launcher on this desktop
    for _ in range(2):
        qtbot.mouseClick(button, Qt.MouseButton.LeftButton)
    said = dialog.usage_label.text()
    assert said.count(f"the folder is {paths.cache_dir() / 'kv'}") == 1, said


def test_the_window_cannot_write_the_database(qtbot, open_window):
    """Its connection is read-only: every change goes through the worker."""
    from sessions.errors import ReadOnlyStorage

    window = open_window()
    with pytest.raises(ReadOnlyStorage, match="cannot be written"):
        window.store.create("any model")


def test_the_preferences_labels_are_in_a_users_words(qtbot):
    """A new user's walk stopped at "Precision groups", "Full precision until" and "Disk
    budget"; a later one read "Disk space for saved chats" as room for the chats."""
    from PySide6.QtWidgets import QLabel

    dialog = PreferencesDialog(Preferences(), 0)
    qtbot.addWidget(dialog)
    labels = {label.text() for label in dialog.findChildren(QLabel)}  # the rows' names too
    assert {"Group size (advanced)", "Full precision for the first (tokens)"} <= labels
    assert "Disk space for reopening chats at once" in labels
    old = {"Precision groups", "Full precision until (tokens)", "Disk budget"}
    assert not labels & (old | {"Disk space for saved chats"})


@pytest.mark.parametrize("device", ["cpu", "gpu"])
def test_the_kv_choices_show_the_trade_offs_measured_for_this_device(qtbot, library, device):
    """The lines come from the benchmark's figures shipped with the app, those of the
    device the model runs on, in plain words; the details only matter when saving."""
    figures = json.loads(KV_FIGURES[device].read_text())
    four = next(r for r in figures["rows"] if r["mode"] == figures["app_modes"]["4-bit"])
    sixteen = next(r for r in figures["rows"] if r["mode"] == "16-bit")
    dialog = PreferencesDialog(Preferences(), 0, device=device)
    qtbot.addWidget(dialog)
    dialog.kv_bits.setCurrentIndex(2)
    line = dialog.kv_explanation.text()
    share = four["kv_bytes"] / sixteen["kv_bytes"]
    assert line.startswith(f"{share:.0%} of the memory of full precision")
    change = four["ppl"] / sixteen["ppl"] - 1
    if abs(change) < 0.01:  # within the measurement's noise: no change, never "better"
        assert "Answers stay the same as far as measured" in line
    else:
        assert f"{abs(change):.1%} {'less' if change > 0 else 'more'} sure of each next" in line
    assert "perplexity" not in line.lower()  # a word a new user stopped at
    assert "Replies come" in line
    assert ("H200" in line) == (device == "gpu") and "4-grams" not in line
    assert dialog.kv_group_size.isEnabled() and dialog.kv_bits.toolTip()
    assert all(getattr(dialog, name).toolTip() for name in FIELDS)  # every setting explained
    dialog.kv_bits.setCurrentIndex(0)
    assert "Full precision" in dialog.kv_explanation.text()
    assert not dialog.kv_group_size.isEnabled()


@pytest.mark.parametrize(
    ("tps", "words"),
    [(21.0, "5% faster"), (16.6, "17% slower"), (20.2, "about as fast")],
)
def test_the_kv_lines_say_the_speed_against_full_precision_in_words(tmp_path, tps, words):
    rows = [
        {"mode": "16-bit", "kv_bytes": 4e6, "ppl": 10.0, "decode_tps": 20.0},
        {"mode": "k8v8", "kv_bytes": 1e6, "ppl": 10.0, "decode_tps": tps},
    ]
    figures = {"rows": rows, "model": "m", "tokens": 2048, "app_modes": {"8-bit": "k8v8"}}
    (tmp_path / "figures.json").write_text(json.dumps(figures))
    assert f"Replies come {words}." in kv_tradeoffs(tmp_path / "figures.json")[8]


def test_without_figures_the_kv_lines_still_say_something(tmp_path):
    (tmp_path / "broken.json").write_text("{not json")
    lines = kv_tradeoffs(tmp_path / "broken.json")
    assert set(lines) == {None, 8, 4} and all(lines.values())


def test_the_event_loop_stays_responsive_during_a_reply(qtbot, open_window, capsys):
    window = open_window()
    ticks = []
    timer = QTimer(interval=10)
    timer.timeout.connect(lambda: ticks.append(time.perf_counter()))
    timer.start()
    send(qtbot, window, "Describe a forest in a few sentences.", greedy_tokens=60)
    timer.stop()
    gaps = [b - a for a, b in itertools.pairwise(ticks)]
    assert len(ticks) > 10
    with capsys.disabled():
        print(
            f"\nlargest event-loop gap during a reply: {max(gaps) * 1000:.0f} ms "
            f"over {len(ticks)} ticks"
        )


def test_closing_during_a_reply_stops_it_and_saves(qtbot, open_window):
    from sessions.cachefiles import CacheIndex

    window = open_window()
    start_long_reply(qtbot, window)
    conversation = window.conversation_id
    window.close()
    assert window.engine.thread.isFinished()
    reply = window.store.get(conversation).messages[-1]
    assert reply.state == "cancelled" and reply.content
    entry = CacheIndex(window.db).conversation(conversation)
    assert entry is not None and len(entry.tokens) > 20


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


HANDLERS = {  # every handler of a worker signal, by the class that has it
    MainWindow: {
        "on_conversation_started",
        "on_restored",
        "on_finished",
        "on_saved",
        "on_preferences_saved",
        "on_changed",
        "on_failed",
        "on_busy",
        "on_context_counted",
    },
    ModelFlow: {"on_loaded", "on_added", "on_import_progress", "on_download_progress"},
    ChatView: {"add_text"},
    TurnStatus: {"on_first_text", "on_text", "on_prompt_progress"},
}
# What the handlers change on screen, patched to note the thread that changes it.
WIDGET_CHANGES = [
    (QLabel, "setText"),
    (QTextEdit, "setHtml"),
    (QListWidget, "addItem"),
    (QProgressBar, "setRange"),
    (QProgressBar, "setValue"),
    (QWidget, "setVisible"),
    (QWidget, "show"),
    (QWidget, "hide"),
]


def slot_names(obj) -> set[str]:
    meta = obj.metaObject()
    return {bytes(meta.method(i).name()).decode() for i in range(meta.methodCount())}


def test_every_worker_signal_is_handled_on_the_gui_thread(qtbot, open_window, monkeypatch):
    """Each handler is a slot of a GUI object, so Qt queues each call to the GUI
    thread, whatever thread emits: no widget is ever changed from the worker's."""
    window = open_window()
    for cls, names in HANDLERS.items():
        shown = (window, window.model_flow, window.chat, window.status)
        obj = next(o for o in shown if type(o) is cls)
        assert names <= slot_names(obj), names - slot_names(obj)

    threads: dict[str, set[int]] = {}

    def noting(cls, name):
        original = getattr(cls, name)

        def change(self, *args):
            threads.setdefault(f"{cls.__name__}.{name}", set()).add(threading.get_ident())
            return original(self, *args)

        return change

    for cls, name in WIDGET_CHANGES:
        monkeypatch.setattr(cls, name, noting(cls, name))
    send(qtbot, window, "Hello!", greedy_tokens=8)
    window.rename_requested.emit(window.conversation_id, "Greetings")
    qtbot.waitUntil(
        lambda: window.sidebar.list.item(0).text().startswith("Greetings"), timeout=5_000
    )
    window.edit_requested.emit(10_000, "no such message")  # fails: the user is told
    monkeypatch.setattr(QMessageBox, "warning", lambda *args: None)
    qtbot.waitUntil(lambda: "No message" in window.status.message.text(), timeout=5_000)
    assert {"QLabel.setText", "QTextEdit.setHtml", "QListWidget.addItem"} <= set(threads)
    assert set().union(*threads.values()) == {threading.main_thread().ident}


def test_the_terminal_replies_as_the_window_does(qtbot, open_window):
    """Same saved preferences, same message: `reprise chat` gives the window's reply."""
    from test_cli import reprise

    window = open_window()
    send(qtbot, window, "Name three rivers.", greedy_tokens=24)
    in_window = window.store.get(window.conversation_id).messages[-1].content
    done = reprise("chat", "--conversation", "new", "--json", "Name three rivers.")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["reply"] == in_window


def test_pasted_bytes_that_are_not_utf8_are_sent_and_stored_as_replacement_marks(
    qtbot, open_window
):
    """A paste from a program that put Latin-1 on the clipboard as text/plain: the bad
    bytes arrive as U+FFFD, the message is sent and stored, the reply comes."""
    window = open_window()
    pasted = QMimeData()
    pasted.setData("text/plain", QByteArray(b"caf\xe9 \xff\xfe, what is 2+2?"))
    window.composer.edit.insertFromMimeData(pasted)
    prefer(window, temperature=0.0, max_tokens=8)
    window.composer.edit.submitted.emit()
    wait_reply(qtbot, window)
    stored = window.store.get(window.conversation_id).messages
    assert stored[0].content == "caf\ufffd \ufffd\ufffd, what is 2+2?"
    assert stored[1].role == "assistant" and stored[1].state == "complete"


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


def test_the_status_bar_says_where_a_reply_started_in_words():
    """Found on new-user walks: "Continuing: 71 tokens already in memory" stayed up after
    the reply; "(6 of 595 tokens were in memory)" explained nothing."""
    from app.ui.turn_status import restore_text

    assert restore_text("memory", 71, 0.0, 80, 71) == "Continuing the chat: reading your message"
    assert restore_text("memory", 71, 0.0, 80, 71, read=True) == ""
    assert restore_text("memory", 6, 0.0, 595, 590, read=True) == (
        "Read the conversation again: it changed near the start (kept 6 of 595 tokens)"
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


def busy_worker(window, monkeypatch):
    """Keep the worker busy until the returned event is set (a slow disk, say): what the
    window asks for meanwhile waits behind it, in order."""
    import threading

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
