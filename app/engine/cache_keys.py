"""What names a saved cache: the model's fingerprint, the KV format of a live
cache, and the content-addressed keys of its chunks."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
from mlx_lm.models.cache import ArraysCache, ChunkedKVCache, KVCache, QuantizedKVCache

from app.engine.kvchunked import ChunkedMixedKVCache
from app.engine.kvquant import MixedKVCache

SNAPSHOT = "snapshot"  # the format of a whole-cache snapshot (app.engine.snapshots)
_MODEL_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
)


def model_fingerprint(model_dir: Path) -> str:
    """Identifies weights, tokenizer and chat template of a model folder.

    Config and tokenizer files are hashed whole; weight files by name, size
    and modification time (hashing gigabytes at every start would be slow;
    imported GGUF models also carry the GGUF's SHA-256 in config.json).
    """
    digest = hashlib.sha256()
    for name in _MODEL_FILES:
        path = model_dir / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        stat = path.stat()
        digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:32]


def kv_format(cache: list) -> str | None:
    """How a chunkable cache stores its tokens: "float32", "float16", "bfloat16" (the
    model's precision) or our scheme's format ("k4v4g64s4h"); None when the layers
    differ or cannot be chunked."""
    formats = set()
    for layer in cache:
        if type(layer) is MixedKVCache and layer.max_size is None:
            formats.add(layer.scheme.format)
        elif type(layer) is KVCache and layer.keys is not None:
            formats.add(str(layer.keys.dtype).split(".")[-1])
        else:
            return None
    return formats.pop() if len(formats) == 1 else None


def tokens_hash(tokens: list[int]) -> str:
    return hashlib.sha256(np.asarray(tokens, dtype="<i4").tobytes()).hexdigest()


def chain_keys(
    fingerprint: str, fmt: str, tokens: list[int], ends: list[int]
) -> list[tuple[str, int, int]]:
    """(key, start, end) of the chunks of `tokens` that end at `ends`, in order; each key
    chains over the whole prefix, so it names the tokens before the chunk as well."""
    result, start = [], 0
    prefix = hashlib.sha256(f"{fingerprint}|{fmt}".encode()).hexdigest()
    for end in ends:
        prefix = hashlib.sha256((prefix + tokens_hash(tokens[start:end])).encode()).hexdigest()
        result.append((prefix[:40], start, end))
        start = end
    return result


def grid_ends(start: int, end: int, size: int) -> list[int]:
    """Where the chunks covering tokens [start, end) end: at each multiple of `size`
    after `start`, then at `end`. A turn's new tokens make at most one short chunk
    at each side; the long stretch between is whole chunks, shareable by any
    conversation with the same prefix."""
    if end <= start:
        return []
    return [*range((start // size + 1) * size, end, size), end]


def chunk_keys(
    fingerprint: str, fmt: str, tokens: list[int], size: int
) -> list[tuple[str, int, int]]:
    """(key, start, end) of each chunk of `size` tokens (the last one shorter)."""
    return chain_keys(fingerprint, fmt, tokens, grid_ends(0, len(tokens), size))


def snapshot_key(fingerprint: str, tokens: list[int]) -> str:
    return chunk_keys(fingerprint, SNAPSHOT, tokens, len(tokens))[0][0]


def checkpoint_key(fingerprint: str, fmt: str, tokens: list[int]) -> str:
    """The key of a checkpoint after `tokens` whose other layers are chunks in `fmt`
    (SNAPSHOT: none are, and the key is a whole snapshot's, as before chunks)."""
    if fmt == SNAPSHOT:
        return snapshot_key(fingerprint, tokens)
    return chunk_keys(fingerprint, f"{SNAPSHOT}+{fmt}", tokens, len(tokens))[0][0]


def cache_parts(cache: list) -> list:
    """Every layer's caches, a CacheList's parts in its place: the slots a chunk
    file's layers and a checkpoint's layout count in."""
    return [part for layer in cache for part in getattr(layer, "caches", (layer,))]


def _dtype_name(array) -> str:
    return str(array.dtype).split(".")[-1]


def _kind_and_format(layer) -> tuple[str, str]:
    """What a layer is ("attention", "sliding window 16", "chunked 16", "state")
    and how it holds its tokens or state."""
    if isinstance(layer, ArraysCache):
        arrays = [a for a in layer.cache if a is not None]
        return "state", _dtype_name(arrays[0]) if arrays else "empty"
    window = getattr(layer, "max_size", None)
    kind = "attention" if window is None else f"sliding window {window}"
    if isinstance(layer, ChunkedKVCache | ChunkedMixedKVCache):
        kind = f"chunked {layer.chunk_size}"
    if isinstance(layer, MixedKVCache):
        return kind, layer.describe()
    if isinstance(layer, QuantizedKVCache):
        return kind, f"{layer.bits}-bit (group {layer.group_size})"
    keys = getattr(layer, "keys", None)
    return kind, _dtype_name(keys) if keys is not None else "empty"


def describe_cache(cache: list | None) -> str:
    """What a live cache holds, per part. One format alone when every layer is
    full attention in it ("float32", as a plain model's always was); otherwise
    each kind of layer with its format, count and bytes:
    "float32 state x2 (0.1 MB) + 8-bit (...) attention x2 (0.3 MB)"."""
    if not cache:
        return "empty"
    groups: dict[tuple[str, str], list[int]] = {}
    for part in cache_parts(cache):
        groups.setdefault(_kind_and_format(part), []).append(part.nbytes)
    if len(groups) == 1 and next(iter(groups))[0] == "attention":
        return next(iter(groups))[1]
    return " + ".join(
        f"{fmt} {kind} x{len(sizes)} ({_size(sum(sizes))})" for (kind, fmt), sizes in groups.items()
    )


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"
