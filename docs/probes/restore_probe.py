"""GPU probe behind the README's restore figures (issue 14): where a cold restore's time
goes beyond the plain read of its files, on a history saved by a real shape with random
weights. Run from the project root on the GPU machine (shared/tools/device-mlx-cuda.md):

    python docs/probes/restore_probe.py TOKENIZER_DIR [--shape qwen3-1.7b]
        [--tokens 16384] [--out FILE]

Each variant runs cold (the files dropped from the page cache first) and warm:
    read              every file read whole, one after another (bench reopen's plain read)
    read ahead        the same reads, four at once (what the restore's readers do)
    read + check      our reader and checksum into host memory, one after another
    restore (host)    the restore as the CPU (and unified memory) path runs it: each file
                      read into host memory, then copied into the layers' buffers
    restore           the restore as the app runs it on the GPU
    restore (a copy per array) the same, each array copied to the device on its own
    restore (mx.array) the same readers, each array handed to mlx with mx.array (managed
                      memory) instead of copied to the device
and for the restores, the seconds spent in each stage, and then in a first use of
every layer on the GPU (what is left for the first token to pay).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from app.bench import reopen, shapes
from app.engine import chunkjoin, kvstore, loading, stored_arrays
from app.engine.conversation import ConversationEngine
from sessions.cachefiles import read_file
from sessions.db import open_db


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("tokenizer", type=Path)
    parser.add_argument("--shape", default="qwen3-1.7b")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="restore-probe-") as scratch:
        os.environ["REPRISE_DATA_DIR"] = str(Path(scratch) / "data")
        os.environ["REPRISE_CACHE_DIR"] = str(Path(scratch) / "cache")
        model_dir = shapes.model_folder(args.shape, args.tokenizer, Path(scratch) / "models")
        loaded = loading.load(model_dir)
        emit(args.out, {"probe": "device", "device": str(mx.default_device()), **h2d()})
        builder = ConversationEngine(open_db(), loaded)
        conversation = builder.store.create(loaded.name)
        reopen.build_history(builder, conversation.id, args.tokens)
        reopen.run_turn(builder, conversation.id, "Summarise this.")
        entry = builder.index.conversation(conversation.id)
        files = reopen.cache_files(builder, conversation.id)
        size = sum(f.stat().st_size for f in files)
        emit(args.out, {"probe": "saved", "tokens": len(entry.tokens), "bytes": size})
        store = ConversationEngine(open_db(), loaded).kvstore
        for name, run in variants(store, entry, files).items():
            for cold in (True, False):
                if not cold:
                    read_all(files)
                row = timed(run, files, cold)
                row |= {"probe": name, "cold": cold, "gb_per_s": size / row["seconds"] / 1e9}
                emit(args.out, row)


def variants(store, entry, files) -> dict[str, Callable[[], dict]]:
    def restore() -> dict:
        result = store.restore(entry, len(entry.tokens))
        assert result.rejected is None, result.rejected
        started = time.perf_counter()
        arrays = [a for layer in result.cache for _, a in tree_flatten(layer.state)]
        mx.eval([mx.sum(array) for array in arrays if isinstance(array, mx.array)])
        return {"first_use_s": time.perf_counter() - started}

    def read_ahead() -> dict:
        for _ in stored_arrays.read_in_threads(Path.read_bytes, [(f,) for f in files], 4):
            pass
        return {}

    def check_all() -> dict:
        for f in files:
            read_file(f, {})
        return {}

    ahead = {"device_apart": lambda: True}
    return {
        "read": lambda: read_all(files),
        "read ahead": read_ahead,
        "read + check": check_all,
        "restore (host)": lambda: staged(restore, device_apart=lambda: False),
        "restore": lambda: staged(restore, **ahead),
        "restore (a copy per array)": lambda: staged(restore, **ahead, to_device=per_array),
        "restore (mx.array)": lambda: staged(restore, **ahead, to_device=to_managed),
    }


def read_all(files: list[Path]) -> dict:
    for f in files:
        f.read_bytes()
    return {}


def to_managed(arrays: dict[str, np.ndarray]) -> dict[str, mx.array]:
    tensors = {name: mx.array(array) for name, array in arrays.items()}
    mx.eval(list(tensors.values()))
    return tensors


def staged(run: Callable[[], dict], **replaced) -> dict:
    """`run` with kvstore's functions `replaced`, and the seconds spent in its stages
    (each summed over calls: the file reads of the read-ahead path overlap)."""
    stages: dict[str, float] = {}
    originals = {
        "read_file": kvstore.read_file,
        "to_device": replaced.get("to_device", kvstore.to_device),
    }
    wrapped = {name: stage(stages, name, f) for name, f in originals.items()}
    built = {"build": stage(stages, "build", chunkjoin.ChunkJoin.build)}
    with patched(kvstore, {**replaced, **wrapped}), patched(chunkjoin.ChunkJoin, built):
        extra = run()
    return {**extra, **{f"{name}_s": seconds for name, seconds in stages.items()}}


def stage(stages: dict, name: str, function: Callable) -> Callable:
    def timed_call(*args, **kwargs):
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            stages[name] = stages.get(name, 0.0) + time.perf_counter() - started

    return timed_call


@contextmanager
def patched(owner, replacements: dict):
    saved = {name: getattr(owner, name) for name in replacements}
    for name, value in replacements.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(owner, name, value)


def timed(run: Callable[[], dict], files: list[Path], cold: bool) -> dict:
    gc.collect()
    if cold:
        reopen.evict(files)
    started = time.perf_counter()
    extra = run()
    return {"seconds": time.perf_counter() - started, **extra}


def h2d(chunks: int = 32, arrays: int = 56, size: int = 1 << 19) -> dict:
    """Host to device, 32 chunks of 56 arrays of 512 KiB (a Qwen3-1.7B chunk's 28
    layers' keys and values): `to_device` (one copy a chunk), one copy an array, and
    mx.array with a first use on the GPU."""
    host = [
        {f"{i}": np.full(size, (c + i) % 251, dtype=np.uint8) for i in range(arrays)}
        for c in range(chunks)
    ]
    stored_arrays.to_device(host[0])  # the first call's set-up
    row = {"h2d_bytes": chunks * arrays * size}
    for name, copy in (("to_device", stored_arrays.to_device), ("per_array", per_array)):
        started = time.perf_counter()
        mx.eval([list(copy(chunk).values()) for chunk in host])
        row[f"{name}_s"] = time.perf_counter() - started
    started = time.perf_counter()
    mx.eval([mx.sum(a) for chunk in host for a in to_managed(chunk).values()])
    row["mx_array_s"] = time.perf_counter() - started
    return row


def per_array(arrays: dict[str, np.ndarray]) -> dict[str, mx.array]:
    """`to_device` one array at a time: a copy (and a wait) for each."""
    return {name: stored_arrays.to_device({name: array})[name] for name, array in arrays.items()}


def emit(path: Path | None, row: dict) -> None:
    print(json.dumps(row), flush=True)
    if path is not None:
        with path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
