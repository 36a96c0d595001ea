"""The window's model: the one picked and its load, the library as the toolbar lists it,
a model added from the Models dialog (whose import or download may end after the dialog
is closed), and a load's failure said once."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from PySide6.QtCore import QObject, Slot

from app.engine.models import STARTER_MODEL, list_models
from app.ui import render
from app.worker import NO_MODELS
from sessions import paths

if TYPE_CHECKING:
    from app.ui.main_window import MainWindow


class ModelFlow(QObject):
    def __init__(self, window: MainWindow) -> None:
        super().__init__(window)
        self.window = window
        self.load_failure = ""  # why the model last asked for did not load, until one does
        self.turn_behind_load = False  # the turn asked for waits on a model load

    @Slot(str)
    def pick(self, name: str) -> None:
        w = self.window
        self.load_failure = ""
        w.ask_to_save(replace(w.preferences(), model=name))
        w.models.show_loading(name)
        w.load_model_requested.emit(name)

    def refresh(self) -> None:
        w = self.window
        names = [m.name for m in list_models(paths.models_dir())]
        w.models.show_models(names, w.preferences().model, STARTER_MODEL)
        w.chat.set_empty_text(render.START if names else render.ADD_A_MODEL)

    def load_chosen(self) -> None:
        """Load the model the toolbar shows (at start, or once the Models dialog added a
        first one); with none in the library, say how to add one: no load to fail, and
        no box to dismiss."""
        w = self.window
        if not w.models.names():
            w.models.show_failed()
            w.status.say(NO_MODELS)
            return
        w.models.show_loading(w.models.current())
        w.load_model_requested.emit(w.models.current())

    @property
    def load_failed(self) -> bool:
        """The model last asked for did not load (and none has since, nor been picked)."""
        return bool(self.load_failure)

    def turn_asked(self) -> None:
        """A turn was asked for: it waits on the load under way, if there is one."""
        self.turn_behind_load = self.window.models.load_pending

    def said_already(self, message: str, loading: bool) -> bool:
        """Whether a failure repeats the load's that a box said already: a message sent
        while a model loads is answered by a turn that loads it again, and fails as the
        load did (said in the status bar only, once: a message sent later gets its box).
        `loading`: the failure is the load's own."""
        if loading:
            self.load_failure = message
        elif message == self.load_failure and self.turn_behind_load:
            self.turn_behind_load = False
            return True
        return False

    @Slot(str, str)
    def on_added(self, name: str, why: str) -> None:
        """A model came into the library (the Models dialog's import or download, which
        may end after the dialog is closed): the toolbar lists it, and loads it where
        the window has none in and none coming, as if picked."""
        w = self.window
        if not name:
            w.status.on_failed(why)
            # Not in a box where the Models dialog says it, where it was asked, nor while
            # quitting: Quit cancels a download, and a box would hold the quit up.
            if not (w.library_open or w.closing):
                w.warn(why)
            return
        w.status.say(f"Added {name}")
        self.refresh()
        if not w.models.ready and w.models.awaited is None:
            self.pick(name)  # the one just added (the chosen one may not load)

    # An import or download goes on after the Models dialog is closed: the status bar
    # follows it there (a new user's walk saw "There is no model yet" all along, then
    # the model, with no word of it).
    @Slot(str, int, int)
    def on_import_progress(self, stage: str, _done: int, _total: int) -> None:
        if not self.window.library_open:
            self.window.status.say(f"Adding the model: {stage}")

    @Slot(object, object, str)
    def on_download_progress(self, done: int, total: int, _file: str) -> None:
        if not self.window.library_open:
            said = f"Downloading the model: {done / 1e6:.1f} of {total / 1e6:.1f} MB"
            self.window.status.say(said)

    @Slot(str, str)
    def on_loaded(self, name: str, compute: str) -> None:
        w = self.window
        if not w.models.show_loaded(name, compute):
            return  # an earlier model's: the one picked since is still loading
        self.load_failure = ""
        w.status.unsay(NO_MODELS)
        w.model_ready()
