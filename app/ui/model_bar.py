"""The model toolbar: which model, and whether it is ready."""

from __future__ import annotations

from PySide6.QtCore import Signal, Slot
from PySide6.QtWidgets import QComboBox, QLabel, QProgressBar, QToolBar

LOADING = "Loading model…"
NO_MODEL = "No model loaded"
READY, REPLYING = "Ready", "Writing a reply…"


class ModelBar(QToolBar):
    picked = Signal(str)  # the user chose another model

    def __init__(self) -> None:
        super().__init__("Model")
        self.setMovable(False)
        self.picker = QComboBox()
        self.picker.setMinimumWidth(240)
        self.state = QLabel(LOADING)
        # Loading reports no steps: a busy bar beside the picker until the model is ready.
        self.loading = QProgressBar()
        self.loading.setRange(0, 0)
        self.loading.setMaximumWidth(120)
        self.addWidget(QLabel(" Model: "))
        self.addWidget(self.picker)
        self.addWidget(QLabel("  "))
        self.addWidget(self.state)
        # A toolbar shows or hides its widgets through their actions.
        self.loading_action = self.addWidget(self.loading)
        self.ready = False
        self.replying = False  # a turn is under way (`show_replying`)
        self.awaited: str | None = None  # the model asked for last, until it is in
        self.compute = ""  # how the loaded model runs, once one is
        self.picker.activated.connect(self._on_activated)

    def show_models(self, names: list[str], *preferred: str) -> None:
        """List `names`, choosing the first of `preferred` that is among them."""
        self.picker.clear()
        self.picker.addItems(names)
        for name in preferred:
            if name in names:
                self.picker.setCurrentText(name)
                break

    def names(self) -> list[str]:
        """Every model in the library, as listed."""
        return [self.picker.itemText(i) for i in range(self.picker.count())]

    def current(self) -> str:
        return self.picker.currentText()

    @property
    def load_pending(self) -> bool:
        """A model was asked for and is not in yet."""
        return self.awaited is not None and not self.ready

    def show_loading(self, name: str) -> None:
        self.ready = False
        self.awaited = name
        self.state.setText(LOADING)
        self.state.setToolTip("")
        self.loading_action.setVisible(True)

    def show_loaded(self, name: str, compute: str) -> bool:
        """Ready; how the model runs (device, weights, BLAS) is a tooltip, not jargon on the
        bar. False, and nothing shown, for another model than the one asked for last (two
        quick picks: the first one's answer came while the second loaded)."""
        if self.awaited not in (None, name):
            return False
        self.awaited = None
        self.ready = True
        self.compute = compute  # "cpu, float32 …" or "gpu, …": which measured figures apply
        self.state.setText(REPLYING if self.replying else READY)
        self.state.setToolTip(f"Running on {compute}")
        self.loading_action.setVisible(False)
        self.picker.setCurrentText(name)
        return True

    def show_replying(self, replying: bool) -> None:
        """Not "Ready" while a reply is written (a new user's walk)."""
        self.replying = replying
        if self.ready:
            self.state.setText(REPLYING if replying else READY)

    def show_failed(self) -> None:
        """The load failed: say so, unless a model loaded before is still there."""
        self.awaited = None
        if not self.ready:
            self.state.setText(NO_MODEL)
            self.loading_action.setVisible(False)

    @Slot(int)
    def _on_activated(self, _index: int) -> None:
        self.picked.emit(self.current())
