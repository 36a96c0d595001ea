"""Take the README's screenshots: the real app in a real X window (run under Xvfb).

    xvfb-run -s "-screen 0 1280x800x24" .venv/bin/python docs/screenshots.py docs/

The first exchange is seeded into a scratch database: the starter model does not
write <think> reasoning, so that reply is typed in here to show how reasoning
blocks look. The follow-up question is answered live by the starter model. The main
window is taken twice: in the light theme and in the dark one (main-window-dark.png).
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

out = Path(sys.argv[1] if len(sys.argv) > 1 else "docs")
scratch = Path(tempfile.mkdtemp(prefix="reprise-shots-"))
os.environ["REPRISE_DATA_DIR"] = str(scratch / "data")
os.environ["REPRISE_CACHE_DIR"] = str(scratch / "cache")

from PySide6.QtCore import QTimer  # noqa: E402
from PySide6.QtWidgets import QApplication, QTabWidget  # noqa: E402

import app.engine  # noqa: E402,F401  (OpenBLAS first)
from app.service.preferences import Preferences  # noqa: E402
from app.ui.models_dialog import ModelsDialog  # noqa: E402
from app.ui.preferences import PreferencesDialog  # noqa: E402
from sessions.conversations import ConversationStore  # noqa: E402
from sessions.db import open_db  # noqa: E402
from sessions.settings import Settings  # noqa: E402

SEEDED_REPLY = """<think>
The user wants a small function. Slicing with a step of -1 reverses a string in Python.
</think>
Here is a short function that reverses a string:

```python
def reverse(text: str) -> str:
    \"\"\"Return text backwards.\"\"\"
    return text[::-1]

print(reverse("Reprise"))  # esirpeR
```

Slicing with `[::-1]` walks the string from the end to the start."""


def seed() -> None:
    db = open_db()
    store = ConversationStore(db)
    store.create("SmolLM2-135M-Instruct", title="Planning a picnic")
    demo = store.create("SmolLM2-135M-Instruct")
    question = store.add_message(demo.id, "user", "How do I reverse a string in Python?")
    store.add_message(demo.id, "assistant", SEEDED_REPLY, parent_id=question.id)
    Preferences(temperature=0.0, max_tokens=120).save(Settings(db))


def main() -> None:
    seed()
    qapp = QApplication(sys.argv)
    from app.ui.main_window import MainWindow

    window = MainWindow()
    window.resize(1180, 760)
    window.show()

    def shot(name: str, widget=None) -> None:
        QApplication.processEvents()
        screen = QApplication.primaryScreen()
        target = widget or window
        screen.grabWindow(
            0,
            target.x(),
            target.y(),
            target.frameGeometry().width(),
            target.frameGeometry().height(),
        ).save(str(out / name))
        print("wrote", out / name)

    def wait_ready():
        if not window.models.ready:
            QTimer.singleShot(200, wait_ready)
            return
        window.sidebar.list.setCurrentRow(0)
        window.chat._thinking_open.add(window.chat.messages[1].id)
        window.chat.render()
        window.composer.edit.setPlainText("Can you also show it with a loop?")
        window.composer.edit.submitted.emit()
        QTimer.singleShot(200, wait_done)

    def wait_done():
        if window.generating:
            QTimer.singleShot(200, wait_done)
            return
        window.chat.verticalScrollBar().setValue(0)
        shot("main-window.png")
        window.ask_to_save(replace(window.preferences(), theme="dark"))
        QTimer.singleShot(800, dark)

    def dark():
        window.chat.verticalScrollBar().setValue(0)
        shot("main-window-dark.png")
        window.ask_to_save(replace(window.preferences(), theme="system"))
        QTimer.singleShot(800, preferences)

    def preferences():
        prefs = PreferencesDialog(window.preferences(), window.index.usage()[1], window)
        prefs.show()
        prefs.findChildren(QTabWidget)[0].setCurrentIndex(1)  # Memory
        prefs.kv_bits.setCurrentIndex(2)  # 4-bit, with its measured trade-off
        QTimer.singleShot(400, lambda: (shot("preferences.png", prefs), prefs.close(), models()))

    def models():
        dialog = ModelsDialog(window.engine.worker, window)
        dialog.show()
        QTimer.singleShot(400, lambda: (shot("models.png", dialog), dialog.close(), cut_reply()))

    def cut_reply():
        """A reply cut by the length limit: marked, with Continue; the context meter."""
        window.save_preferences_requested.emit(replace(window.preferences(), max_tokens=24))
        window.new_chat()
        window.composer.edit.setPlainText("Write a story about a lighthouse keeper.")
        window.composer.edit.submitted.emit()
        QTimer.singleShot(300, wait_cut)

    def wait_cut():
        if window.generating:
            QTimer.singleShot(200, wait_cut)
            return
        window.composer.edit.setPlainText("And what happened next, in the keeper's own words?")
        QTimer.singleShot(1500, lambda: (shot("cut-reply.png"), too_long()))

    def too_long():
        window.save_preferences_requested.emit(replace(window.preferences(), max_context=200))
        window.composer.edit.setPlainText("Summarise this page: " + "lorem ipsum dolor " * 60)
        QTimer.singleShot(1500, lambda: (shot("context-warning.png"), window.close(), qapp.quit()))

    QTimer.singleShot(300, wait_ready)
    qapp.exec()


main()
