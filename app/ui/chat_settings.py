"""A chat's own settings: the words for them, and the dialog that edits them.

Each setting is either the chat's own value or "Default" (the preference's, which
follows Preferences as it changes). In a spin box the default is the step below
the lowest value, shown as "Default: 0.7"; the KV choice has its own entry.
"""

from __future__ import annotations

from PySide6.QtGui import QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QAbstractSpinBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFormLayout,
    QLabel,
    QMessageBox,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.service.preferences import InvalidPreference, Preferences
from app.ui.preferences import kv_label
from app.ui.setting_words import FIELDS, KV_TIP, wrapped
from sessions.overrides import KV_OFF, ChatOverrides


def kv_words(bits: int | None) -> str:
    """The KV setting as the header says it."""
    return "full precision (no memory saving)" if bits is None else f"{bits}-bit memory saving"


def differences(overrides: ChatOverrides, prefs: Preferences) -> list[str]:
    """What this chat runs with that differs from the defaults, in plain words."""
    mine = prefs.for_chat(overrides)
    said = []
    for name, (label, *_rest) in FIELDS.items():
        value = getattr(mine, name)
        if value != getattr(prefs, name):
            said.append(
                f"Replies up to {value:,} tokens" if name == "max_tokens" else f"{label} {value:g}"
            )
    if mine.kv_bits != prefs.kv_bits:
        said.append(kv_words(mine.kv_bits).capitalize())
    return said


class ChatSettingsDialog(QDialog):
    """Tab moves through the settings to the buttons; Enter or Ctrl+Enter saves, Esc
    cancels; "Use defaults" sets every one back to the preference."""

    def __init__(self, parent: QWidget | None, overrides: ChatOverrides, prefs: Preferences):
        super().__init__(parent)
        self.setWindowTitle("Chat settings")
        self.prefs = prefs
        self.chosen: ChatOverrides | None = None  # set by Save
        note = QLabel(
            "Settings for this chat only. “Default” follows Preferences, also when it changes."
        )
        note.setWordWrap(True)
        form = QFormLayout()
        self.boxes: dict[str, QAbstractSpinBox] = {}
        for name, (label, tip, low, high, step) in FIELDS.items():
            box = self._box(name, low, high, step, getattr(overrides, name))
            default = " To follow Preferences again, lower it past its lowest value to “Default”."
            box.setToolTip(wrapped(tip + default))
            form.addRow(label, box)
            self.boxes[name] = box
        self.kv_bits = QComboBox()
        self.kv_bits.addItem(f"Default: {kv_label(prefs.kv_bits)}", None)
        for bits in (KV_OFF, 8, 4):
            self.kv_bits.addItem(kv_label(None if bits == KV_OFF else bits), bits)
        self.kv_bits.setCurrentIndex(max(0, self.kv_bits.findData(overrides.kv_bits)))
        self.kv_bits.setToolTip(wrapped(KV_TIP))
        form.addRow("Memory saving", self.kv_bits)
        self.buttons = QDialogButtonBox(
            QDialogButtonBox.StandardButton.Save
            | QDialogButtonBox.StandardButton.Cancel
            | QDialogButtonBox.StandardButton.RestoreDefaults
        )
        self.save_button = self.buttons.button(QDialogButtonBox.StandardButton.Save)
        self.save_button.setDefault(True)
        self.reset_button = self.buttons.button(QDialogButtonBox.StandardButton.RestoreDefaults)
        self.reset_button.setText("Use defaults")
        self.reset_button.setToolTip("Set every setting of this chat back to Preferences'")
        self.reset_button.setAutoDefault(False)  # Enter saves, wherever the focus is
        self.reset_button.clicked.connect(self.use_defaults)
        self.buttons.accepted.connect(self.accept)
        self.buttons.rejected.connect(self.reject)
        for keys in ("Ctrl+Return", "Ctrl+Enter"):
            QShortcut(QKeySequence(keys), self, activated=self.accept)
        layout = QVBoxLayout(self)
        layout.addWidget(note)
        layout.addLayout(form)
        layout.addWidget(self.buttons)
        self.setMinimumWidth(480)
        self.boxes["temperature"].setFocus()

    def _box(self, name: str, low, high, step, own) -> QAbstractSpinBox:
        whole = isinstance(low, int)
        box = QSpinBox() if whole else QDoubleSpinBox()
        if not whole:
            box.setDecimals(2)
        default = getattr(self.prefs, name)
        box.setRange(low - step, high)  # the step below the lowest: the default
        box.setSingleStep(step)
        box.setSpecialValueText(f"Default: {default:g}")
        box.setValue(box.minimum() if own is None else own)
        return box

    def use_defaults(self) -> None:
        for box in self.boxes.values():
            box.setValue(box.minimum())
        self.kv_bits.setCurrentIndex(0)

    def overrides(self) -> ChatOverrides:
        """The settings as the dialog shows them."""
        values = {
            name: None if box.value() == box.minimum() else box.value()
            for name, box in self.boxes.items()
        }
        return ChatOverrides(**values, kv_bits=self.kv_bits.currentData())

    def accept(self) -> None:
        try:
            self.chosen = self.prefs.check_chat(self.overrides())
        except InvalidPreference as exc:  # a value the boxes allow and the rules do not
            QMessageBox.warning(self, "Chat settings", f"The {exc}.")
            return
        super().accept()


def chat_settings(
    parent: QWidget, overrides: ChatOverrides, prefs: Preferences
) -> ChatOverrides | None:
    """This chat's settings as the user set them; None when cancelled or unchanged."""
    dialog = ChatSettingsDialog(parent, overrides, prefs)
    if not dialog.exec() or dialog.chosen == overrides:
        return None
    return dialog.chosen
