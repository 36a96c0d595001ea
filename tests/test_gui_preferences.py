"""Preferences from the window: saved, in a user's words, the memory-saving trade-offs
measured for this device, and the cache folder (Qt offscreen)."""

from __future__ import annotations

import json

import pytest
from gui_window import send, when_a_box_opens
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel, QMessageBox, QPushButton

from app.service.preferences import Preferences
from app.ui.preferences import KV_FIGURES, PreferencesDialog, kv_tradeoffs
from app.ui.setting_words import FIELDS
from sessions.db import open_db
from sessions.settings import Settings


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
    # Asked first (a walk: it acted at once, in a dialog whose Cancel did not undo it).
    when_a_box_opens(lambda box: box.button(QMessageBox.StandardButton.No).click())
    qtbot.mouseClick(clear, Qt.MouseButton.LeftButton)
    qtbot.wait(300)
    assert window.index.usage()[1] > 0 and not dialog.usage_label.text().startswith("0.0 MB")
    when_a_box_opens(lambda box: box.button(QMessageBox.StandardButton.Yes).click())
    qtbot.mouseClick(clear, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: dialog.usage_label.text().startswith("0.0 MB"), timeout=10_000)
    window.refresh_sidebar()
    assert "resumes by rereading" in window.sidebar.list.item(0).text()
    # A chat opened now has nothing to restore: it says so before Send, not after a wait.
    window.sidebar.conversation_selected.emit(other)
    said = "Nothing saved to resume this chat: its next reply rereads it"
    qtbot.waitUntil(lambda: window.status.message.text() == said, timeout=10_000)


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


def test_the_preferences_labels_are_in_a_users_words(qtbot):
    """A new user's walk stopped at "Precision groups", "Full precision until" and "Disk
    budget"; a later one read "Disk space for saved chats" as room for the chats."""

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
    assert "x86" not in line and "CPU path" not in line  # jargon a new user stopped at
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
