"""Preferences: generation, memory (KV cache quantization), storage.

The dialog edits a `Preferences` value and hands back a new one; the worker
saves it (the window never writes). Changes apply to the next turn.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from importlib.resources.abc import Traversable

from PySide6.QtCore import Qt, QUrl, Signal, SignalInstance, Slot
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QMessageBox,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from app.resource_files import resource
from app.service.preferences import (
    GROUP_SIZES,
    KV_CHOICES,
    THEME_CHOICES,
    InvalidPreference,
    Preferences,
)
from app.ui.setting_words import FIELDS, KV_TIP, wrapped
from app.ui.theme import THEME_LABELS, chat_colours
from sessions import paths

# `reprise bench kv --save resources/kv-bench.json` (on the H200) and `...-cpu.json` (on this
# project's 2-core CPU): the measured trade-offs shown here, for the device the model runs on.
KV_FIGURES = {"gpu": resource("kv-bench.json"), "cpu": resource("kv-bench-cpu.json")}
_MEASURED_ON = {
    "gpu": "on an NVIDIA H200 GPU (not measured on Apple silicon)",
    "cpu": "on a 2-core PC processor",  # not "the CPU path, 2 x86 cores" (a new user's walk)
}
GROUP_HELP = (
    "How many numbers share one scale when they are stored in fewer bits: smaller groups "
    "are more precise and take a little more memory. 64 suits most models."
)
START_HELP = "The first tokens of every chat stay at full precision until it is this long."


def kv_label(bits: int | None) -> str:
    """The KV choice in the words the whole window uses (the status bar too)."""
    return "Off (full precision)" if bits is None else f"{bits}-bit"


def kv_label_of(kv_format: str) -> str:
    """A finished turn's cache format ("4-bit (group 64, ...)", "float32", or per kind of
    layer: "float32 state x1 (1.0 kB) + 8-bit (...) sliding window 64 x2 (69.6 kB)") in
    those words: the bits its attention layers are held in, where any are quantized."""
    for bits in ("8-bit", "4-bit"):
        if any(part.startswith(bits) for part in kv_format.split(" + ")):
            return bits
    return kv_label(None)


# The perplexity `bench kv` measures moves by about this much between runs that differ
# only in summation order (README), so a smaller change is no change anyone measured.
PERPLEXITY_NOISE = 0.01


def _quality(change: float) -> str:
    """A perplexity change in words, without the word (a new user's walk stopped at it):
    how much less sure the model is of each next word. Within the measurement's noise it
    is no change (a -0.1% read as "better")."""
    if abs(change) < PERPLEXITY_NOISE:
        return "Answers stay the same as far as measured (within its 1% noise)."
    surer = "less" if change > 0 else "more"
    return f"Answers stay close: the model is {abs(change):.1%} {surer} sure of each next word."


def _speed(ratio: float) -> str:
    """A decode speed against full precision's, in words (within 2%: measurement noise)."""
    if abs(ratio - 1) < 0.02:
        return "Replies come about as fast."
    if ratio > 1:
        return f"Replies come {ratio - 1:.0%} faster."
    return f"Replies come {1 - ratio:.0%} slower."


def kv_tradeoffs(path: Traversable = KV_FIGURES["cpu"], device: str = "cpu") -> dict:
    """One plain line per KV choice, from the figures `reprise bench kv` measured."""
    lines = {None: "Full precision: the most memory; answers as the model gives them."}
    try:
        figures = json.loads(path.read_text())
        rows = {row["mode"]: row for row in figures["rows"]}
        base = rows["16-bit"]
        where = f"{figures['model']}, {figures['tokens']:,} tokens, {_MEASURED_ON[device]}"
        lines[None] = (
            f"Full precision: the most memory ({base['kv_bytes'] / 1e6:.0f} MB at "
            f"{figures['tokens']:,} tokens on {figures['model']}); answers as the model gives them."
        )
        for label, mode in figures["app_modes"].items():
            row = rows[mode]
            lines[int(label.split("-")[0])] = (
                f"{row['kv_bytes'] / base['kv_bytes']:.0%} of the memory of full precision. "
                f"{_quality(row['ppl'] / base['ppl'] - 1)} "
                f"{_speed(row['decode_tps'] / base['decode_tps'])} "
                f"Measured with {where}."
            )
    except (OSError, ValueError, KeyError, TypeError):
        lines |= {8: "About half the memory of 16-bit.", 4: "About a third of the memory."}
    return lines


GB = 10**9  # as every other size in the window says it (a walk saw "10.00 GiB" here)


def usage_text(usage: int) -> str:
    return f"{usage / 1e6:.1f} MB in {paths.cache_dir() / 'kv'}"


class PreferencesDialog(QDialog):
    clear_caches_requested = Signal()

    def __init__(
        self, prefs: Preferences, cache_usage_bytes: int, parent=None, device: str = "cpu"
    ) -> None:
        super().__init__(parent)
        self.device = device if device in KV_FIGURES else "cpu"
        self.setWindowTitle("Preferences")
        self.initial = prefs
        self.chosen: Preferences | None = None  # set by OK
        values = vars(prefs)
        tabs = QTabWidget()
        tabs.addTab(self._generation_tab(values), "Generation")
        tabs.addTab(self._memory_tab(values), "Memory")
        tabs.addTab(self._storage_tab(values, cache_usage_bytes), "Storage")
        tabs.addTab(self._appearance_tab(values), "Appearance")
        buttons = QDialogButtonBox(
            QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel
        )
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addWidget(tabs)
        layout.addWidget(buttons)
        self.resize(520, 420)

    def _generation_tab(self, values: dict) -> QWidget:
        page = QWidget()
        form = QFormLayout(page)
        self.temperature = self._double(0.0, 2.0, 0.05, values["temperature"])
        self.top_p = self._double(0.0, 1.0, 0.01, values["top_p"])
        self.min_p = self._double(0.0, 1.0, 0.01, values["min_p"])
        self.repetition_penalty = self._double(0.5, 2.0, 0.01, values["repetition_penalty"])
        self.max_tokens = self._int(1, 32768, values["max_tokens"])
        self.system_prompt = QPlainTextEdit(values["system_prompt"] or "")
        self.system_prompt.setPlaceholderText("The model's own default")
        for name in FIELDS:
            label, tip = FIELDS[name][:2]
            box = getattr(self, name)
            box.setToolTip(wrapped(tip))
            form.addRow(label, box)
        form.addRow("Default system prompt", self.system_prompt)
        return page

    def _memory_tab(self, values: dict) -> QWidget:
        page = QWidget()
        form = QFormLayout(page)
        self.kv_bits = QComboBox()
        self.kv_lines = kv_tradeoffs(KV_FIGURES[self.device], self.device)
        for bits in KV_CHOICES:
            self.kv_bits.addItem(kv_label(bits), bits)
        self.kv_bits.setCurrentIndex(KV_CHOICES.index(values["kv_bits"]))
        self.kv_explanation = QLabel()
        self.kv_explanation.setWordWrap(True)
        self.kv_bits.currentIndexChanged.connect(self._explain_kv)
        self.kv_group_size = QComboBox()
        for size in GROUP_SIZES:
            self.kv_group_size.addItem(str(size), size)
        self.kv_group_size.setCurrentText(str(values["kv_group_size"]))
        self.quantized_kv_start = self._int(0, 1_000_000, values["quantized_kv_start"])
        self.kv_warning = QLabel()
        self.kv_warning.setWordWrap(True)
        self.kv_warning.setStyleSheet(f"color: {chat_colours().warning}")
        self.kv_bits.setToolTip(wrapped(KV_TIP))
        self.kv_group_size.setToolTip(wrapped(GROUP_HELP))
        self.quantized_kv_start.setToolTip(wrapped(START_HELP))
        form.addRow("Memory saving", self.kv_bits)
        form.addRow("", self.kv_explanation)
        form.addRow("Group size (advanced)", self.kv_group_size)
        form.addRow("Full precision for the first (tokens)", self.quantized_kv_start)
        self.max_context = self._int(0, 1_048_576, values["max_context"] or 0)
        self.max_context.setSpecialValueText("The model's own")
        form.addRow("Maximum context (tokens)", self.max_context)
        form.addRow("", self.kv_warning)
        self._initial_kv = (values["kv_bits"], values["kv_group_size"])
        self.kv_group_size.currentIndexChanged.connect(self._explain_kv)
        self._explain_kv()
        return page

    @Slot()
    def open_cache_folder(self) -> None:
        """The folder "In use" names, in the file manager; where none can be opened (no
        desktop launcher), the folder's path, to copy."""
        folder = paths.cache_dir() / "kv"
        if not folder.is_dir():
            folder = paths.cache_dir()
        if not QDesktopServices.openUrl(QUrl.fromLocalFile(str(folder))):
            in_use = self.usage_label.text().split("\n")[0]
            said = f"No file manager could open it: the folder is {folder}"
            self.usage_label.setText(f"{in_use}\n{said}")
            self.usage_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)

    def _storage_tab(self, values: dict, usage: int) -> QWidget:
        page = QWidget()
        form = QFormLayout(page)
        self.budget = self._double(0.1, 10_000, 0.5, values["cache_budget_bytes"] / GB)
        self.budget.setSuffix(" GB")
        self.usage_label = QLabel(usage_text(usage))
        clear = QPushButton("Clear caches")
        clear.clicked.connect(self._clear_if_sure)
        open_folder = QPushButton("Open cache folder")
        open_folder.clicked.connect(self.open_cache_folder)
        row = QHBoxLayout()
        row.addWidget(clear)
        row.addWidget(open_folder)
        # Not "saved chats": the chats are kept whatever this says (a new user's walk).
        form.addRow("Disk space for reopening chats at once", self.budget)
        form.addRow("In use", self.usage_label)
        form.addRow(
            "",
            QLabel("Clearing them only makes reopening slower: no message is ever lost."),
        )
        form.addRow(row)
        return page

    @Slot()
    def _clear_if_sure(self) -> None:
        """Asked first: it acts at once, and Cancel on this dialog does not undo it (a
        new user's walk)."""
        said = (
            f"Delete what was saved to reopen chats at once ({self.usage_label.text()})? "
            "No message is lost: each chat is read again the next time it is continued."
        )
        buttons = QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No
        answer = QMessageBox.question(
            self, "Clear caches", said, buttons, QMessageBox.StandardButton.No
        )
        if answer == QMessageBox.StandardButton.Yes:
            self.clear_caches_requested.emit()

    def follow_usage(self, changed: SignalInstance, usage: Callable[[], int]) -> None:
        """Show the caches' size again whenever `changed` says the worker changed
        something (Clear caches, from this dialog): not the size it had when opened."""
        self._usage = usage
        changed.connect(self._show_usage)

    @Slot(int)
    def _show_usage(self, _conversation_id: int = 0) -> None:
        self.usage_label.setText(usage_text(self._usage()))

    def _appearance_tab(self, values: dict) -> QWidget:
        page = QWidget()
        form = QFormLayout(page)
        self.theme = QComboBox()
        for choice in THEME_CHOICES:
            self.theme.addItem(THEME_LABELS[choice], choice)
        self.theme.setCurrentIndex(THEME_CHOICES.index(values["theme"]))
        self.theme.setToolTip(
            'Light or dark colours for the window and the chat. "Same as the system" '
            "follows your desktop's setting, also when it changes while Reprise runs."
        )
        form.addRow("Theme", self.theme)
        return page

    def _explain_kv(self) -> None:
        self.kv_explanation.setText(self.kv_lines.get(self.kv_bits.currentData(), ""))
        saving = self.kv_bits.currentData() is not None  # the details matter only then
        self.kv_group_size.setEnabled(saving)
        self.quantized_kv_start.setEnabled(saving)
        now = (self.kv_bits.currentData(), self.kv_group_size.currentData())
        changed = now != self._initial_kv and self._initial_kv[0] is not None
        self.kv_warning.setText(
            "Caches in the current quantized format cannot be used with this setting: "
            "those conversations are read again from the start at their next message, once."
            if changed
            else ""
        )

    @staticmethod
    def _double(low: float, high: float, step: float, value: float) -> QDoubleSpinBox:
        box = QDoubleSpinBox()
        box.setRange(low, high)
        box.setSingleStep(step)
        box.setDecimals(2)
        box.setValue(value)
        return box

    @staticmethod
    def _int(low: int, high: int, value: int) -> QSpinBox:
        box = QSpinBox()
        box.setRange(low, high)
        box.setValue(value)
        return box

    def preferences(self) -> Preferences:
        """The preferences as the dialog shows them."""
        return replace(
            self.initial,
            temperature=self.temperature.value(),
            top_p=self.top_p.value(),
            min_p=self.min_p.value(),
            repetition_penalty=self.repetition_penalty.value(),
            max_tokens=self.max_tokens.value(),
            system_prompt=self.system_prompt.toPlainText(),
            kv_bits=self.kv_bits.currentData(),
            kv_group_size=self.kv_group_size.currentData(),
            quantized_kv_start=self.quantized_kv_start.value(),
            max_context=self.max_context.value() or None,
            cache_budget_bytes=int(self.budget.value() * GB),
            theme=self.theme.currentData(),
        )

    def accept(self) -> None:
        try:
            self.chosen = self.preferences()
        except InvalidPreference as exc:  # a value the spin boxes allow and the rules do not
            QMessageBox.warning(self, "Preferences", f"The {exc}.")
            return
        super().accept()
