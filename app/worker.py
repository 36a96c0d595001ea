"""The one worker that owns the engine, on its own QThread (DESIGN.md §2).

Every MLX call happens on the worker's thread; the GUI talks to it only
through queued signals and slots, and it answers with plain data, one signal
per event. Stop is a flag the generation loop checks between tokens.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import QObject, QThread, Signal, Slot

from app.engine import loading, models
from app.engine.conversation import CacheSaved, ConversationEngine, RestoreInfo, TurnOptions
from app.engine.errors import UserError
from app.engine.generation import (
    KVSettings,
    PromptProgress,
    SamplingSettings,
    TextDelta,
    TurnFinished,
)
from sessions import paths
from sessions.db import open_db
from sessions.settings import Settings


def options_from_settings(values: dict) -> TurnOptions:
    return TurnOptions(
        system=values.get("system_prompt") or None,
        sampling=SamplingSettings(
            temperature=values["temperature"],
            top_p=values["top_p"],
            min_p=values["min_p"],
            repetition_penalty=values["repetition_penalty"],
            max_tokens=values["max_tokens"],
        ),
        kv=KVSettings(values["kv_bits"], values["kv_group_size"], values["quantized_kv_start"]),
        max_context=values["max_context"] or None,
    )


class EngineWorker(QObject):
    model_loaded = Signal(str, str)  # name, compute path
    text_delta = Signal(str)
    prompt_progress = Signal(int, int)  # done, total
    cache_restored = Signal(str, int, float)  # source, tokens, seconds
    finished = Signal(dict)  # TurnStats as a dict, with extras
    cancelled = Signal()
    failed = Signal(str)  # a message for the user
    saved = Signal(dict)  # chunks and bytes written, or an error
    busy_changed = Signal(bool)
    import_progress = Signal(str, int, int)  # stage, done, total
    download_progress = Signal(int, int, str)  # bytes done, bytes in all, file
    model_added = Signal(str)  # the new model's name; "" when an import or download failed

    def __init__(self) -> None:
        super().__init__()
        self._stop = threading.Event()
        self._engine: ConversationEngine | None = None
        self._db = None

    # Called directly from the GUI thread: it only sets a flag.
    def stop(self) -> None:
        self._stop.set()

    @Slot(str)
    def load_model(self, name: str) -> None:
        """Not "busy": a message sent meanwhile is queued and answered once loaded."""
        try:
            if self._db is None:
                self._db = open_db()  # this thread's own connection
            settings = Settings(self._db)
            path = models.resolve(name or settings.get("model"), paths.models_dir())
            if self._engine is None or self._engine.loaded.path != path:
                self._engine = ConversationEngine(
                    self._db,
                    loading.load(path),
                    chunk_tokens=settings.get("cache_chunk_tokens"),
                    budget_bytes=settings.get("cache_budget_bytes"),
                )
            loaded = self._engine.loaded
            self.model_loaded.emit(loaded.name, loaded.compute.describe())
        except UserError as exc:
            self.failed.emit(str(exc))
        except Exception:  # a bug: show it rather than die silently
            self.failed.emit(f"Loading the model failed:\n{traceback.format_exc()}")

    @Slot(str, str)
    def import_gguf(self, path: str, name: str) -> None:
        """Import a GGUF file into the library (mlx reads it, so it runs here)."""
        from app.engine.gguf_import import import_gguf

        def report(stage: str, done: int, total: int) -> None:
            self.import_progress.emit(stage, done, total)

        self._add_model(
            lambda: import_gguf(Path(path), paths.models_dir(), name or None, report).path
        )

    @Slot(str)
    def download_model(self, repo_id: str) -> None:
        """Fetch an MLX model from the hub; Stop (the same flag) cancels it."""
        from app.engine.download import download_model, hub_endpoint

        def report(done: int, total: int, file: str) -> None:
            self.download_progress.emit(done, total, file)

        self._stop.clear()
        self._add_model(
            lambda: download_model(
                repo_id,
                paths.models_dir(),
                endpoint=hub_endpoint(),
                progress=report,
                should_cancel=self._stop.is_set,
            )
        )

    def _add_model(self, task: Callable[[], Path]) -> None:
        """Run an import or download; `model_added` names the new model, or is empty."""
        self.busy_changed.emit(True)
        added = ""
        try:
            added = task().name
        except UserError as exc:
            self.failed.emit(str(exc))
        except Exception:
            self.failed.emit(f"Adding the model failed:\n{traceback.format_exc()}")
        finally:
            self.model_added.emit(added)
            self.busy_changed.emit(False)

    @Slot(int, str)
    def send(self, conversation_id: int, text: str) -> None:
        self._run(lambda engine, options, stop: engine.send(conversation_id, text, options, stop))

    @Slot(int)
    def regenerate(self, conversation_id: int) -> None:
        self._run(lambda engine, options, stop: engine.regenerate(conversation_id, options, stop))

    @Slot(int, str)
    def edit(self, message_id: int, text: str) -> None:
        self._run(lambda engine, options, stop: engine.edit(message_id, text, options, stop))

    def _run(self, start) -> None:
        if self._engine is None:
            self.failed.emit("No model is loaded yet.")
            return
        self._stop.clear()
        self.busy_changed.emit(True)
        try:
            options = options_from_settings(Settings(self._db).all())
            for event in start(self._engine, options, self._stop.is_set):
                if isinstance(event, RestoreInfo):
                    self.cache_restored.emit(event.source, event.tokens, event.seconds)
                elif isinstance(event, TextDelta):
                    self.text_delta.emit(event.text)
                elif isinstance(event, PromptProgress):
                    self.prompt_progress.emit(event.done, event.total)
                elif isinstance(event, TurnFinished):
                    stats = event.stats.to_dict()
                    if event.stats.finish_reason == "cancelled":
                        self.cancelled.emit()
                    self.finished.emit(stats)
                elif isinstance(event, CacheSaved):
                    self.saved.emit(
                        {
                            "bytes": event.report.bytes_written,
                            "chunks": event.report.chunks_written,
                            "seconds": event.report.seconds,
                            "error": event.error,
                        }
                    )
        except UserError as exc:
            self.failed.emit(str(exc))
        except Exception:
            self.failed.emit(f"Something went wrong:\n{traceback.format_exc()}")
        finally:
            self.busy_changed.emit(False)


class WorkerThread:
    """Starts the worker on its own thread, and stops it cleanly."""

    def __init__(self) -> None:
        self.thread = QThread()
        self.thread.setObjectName("engine")
        self.worker = EngineWorker()
        self.worker.moveToThread(self.thread)
        self.thread.start()

    def shutdown(self, timeout_ms: int = 120_000) -> None:
        """Stop any reply; the thread finishes its current slot (and its save) first."""
        self.worker.stop()
        self.thread.quit()
        self.thread.wait(timeout_ms)
