"""llama.cpp beside `bench reopen`: the same GGUF, the same tokens, its own state file.

llama.cpp saves a context's state (its KV cache and the tokens) with
`llama_state_save_file` and reads it back with `llama_state_load_file`, the calls
behind its own prompt cache. The peer prefills the history, saves the state, and then
a new context (as after a restart; the model load is not counted, as it is not for
Reprise) loads the file, reads the new message's tokens and gives its first token.
Recomputing (a new context reading everything) is measured too.

Needs llama-cpp-python (a bench extra, not a dependency: `pip install llama-cpp-python`).
"""

from __future__ import annotations

import ctypes
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from app.engine.errors import UserError


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def gguf_for(peer: str | None, path: Path | None) -> Path | None:
    """The GGUF `--peer llama.cpp` reads (`--peer-gguf`, else $REPRISE_STARTER_GGUF), or
    None without `--peer`; a clear error when llama.cpp or the file is missing."""
    if peer is None:
        return None
    if not available():
        raise UserError("--peer llama.cpp needs llama-cpp-python: pip install llama-cpp-python")
    gguf = path or os.environ.get("REPRISE_STARTER_GGUF")
    if not gguf or not Path(gguf).is_file():
        raise UserError("--peer llama.cpp reads a GGUF: give it with --peer-gguf PATH")
    return Path(gguf)


def threads() -> int:
    return os.cpu_count() or 1


def speed(gguf: Path, prompt: Sequence[int], decode_tokens: int) -> dict:
    """llama.cpp's prefill of `prompt` and its greedy decode of `decode_tokens` after
    it, in tokens per second (what `bench cpu` puts beside the engine's)."""
    llm = _context(gguf, len(prompt) + decode_tokens + 16, threads())
    started = time.perf_counter()
    token = _first_token(llm, prompt)
    prefill_s = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(decode_tokens):
        token = _first_token(llm, [token])
    decode_s = time.perf_counter() - started
    return {"prefill_tps": len(prompt) / prefill_s, "decode_tps": decode_tokens / decode_s}


def _context(gguf: Path, n_ctx: int, threads: int):
    from llama_cpp import Llama

    return Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, verbose=False)


def _first_token(llm, tokens: Sequence[int]) -> int:
    """Read `tokens` after what the context holds; the greedy next token (from the last
    row of logits llama.cpp keeps: llama-cpp-python's own `scores` holds one batch)."""
    import llama_cpp
    import numpy as np

    llm.eval(list(tokens))
    logits = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return int(np.ctypeslib.as_array(logits, shape=(llm.n_vocab(),)).argmax())


def measure(gguf: Path, history: Sequence[int], new: Sequence[int], threads: int) -> dict:
    """llama.cpp's state size, its reopen TTFT (load the state file, read `new`, one
    token) and its TTFT recomputing history and `new` from nothing."""
    with tempfile.TemporaryDirectory(prefix="reprise-peer-") as scratch:
        return _measure(gguf, history, new, Path(scratch) / "llama-cpp.state", threads)


def _measure(
    gguf: Path, history: Sequence[int], new: Sequence[int], state_file: Path, threads: int
) -> dict:
    import llama_cpp

    n_ctx = len(history) + len(new) + 16
    writer = _context(gguf, n_ctx, threads)
    writer.eval(list(history))
    ids = (llama_cpp.llama_token * len(history))(*history)
    if not llama_cpp.llama_state_save_file(
        writer._ctx.ctx, str(state_file).encode(), ids, len(history)
    ):
        raise RuntimeError("llama.cpp could not save its state")
    del writer

    reader = _context(gguf, n_ctx, threads)
    started = time.perf_counter()
    loaded = (llama_cpp.llama_token * n_ctx)()
    count = ctypes.c_size_t(0)
    if not llama_cpp.llama_state_load_file(
        reader._ctx.ctx, str(state_file).encode(), loaded, n_ctx, ctypes.byref(count)
    ):
        raise RuntimeError("llama.cpp could not load its state")
    reader.n_tokens = count.value
    reader.input_ids[: count.value] = list(loaded[: count.value])
    load_s = time.perf_counter() - started
    first = _first_token(reader, new)
    reopen_ttft_s = time.perf_counter() - started
    del reader

    fresh = _context(gguf, n_ctx, threads)
    started = time.perf_counter()
    recomputed = _first_token(fresh, [*history, *new])
    recompute_ttft_s = time.perf_counter() - started
    return {
        "llama_cpp_state_bytes": state_file.stat().st_size,
        "llama_cpp_load_s": load_s,
        "llama_cpp_ttft_s": reopen_ttft_s,
        "llama_cpp_recompute_ttft_s": recompute_ttft_s,
        "llama_cpp_same_first_token": first == recomputed,
    }
