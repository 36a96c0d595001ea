"""A conversation's saved KV cache as a file mlx-lm loads (`load_prompt_cache`).

Our quantized layers (`MixedKVCache`) are ours alone: mlx-lm has no class of
that name, so they are written as what attention reads from them, dequantized
into mlx-lm's `KVCache` (or `RotatingKVCache` for a sliding window,
`ChunkedKVCache` for a chunked layer). Plain, rotating, chunked and state layers
are written as they are.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import (
    CacheList,
    ChunkedKVCache,
    KVCache,
    RotatingKVCache,
    save_prompt_cache,
)

from app.engine.errors import UserError
from app.engine.kvchunked import ChunkedMixedKVCache
from app.engine.kvquant import MixedKVCache
from app.engine.kvstore import KVStore

SUFFIX = ".safetensors"  # mlx appends it to a name without it: we say so up front


class ExportFailed(UserError):
    pass


@dataclass(frozen=True)
class Exported:
    path: Path
    tokens: int
    dequantized_layers: int


def export_path(out: Path) -> Path:
    """Where the file will really be: mlx writes `name.safetensors` for `name`."""
    out = out.expanduser()
    if out.is_dir():
        raise ExportFailed(f"{out} is a folder; give a file name, e.g. {out / 'chat.safetensors'}")
    return out if out.name.endswith(SUFFIX) else out.with_name(out.name + SUFFIX)


def export_cache(kvstore: KVStore, conversation_id: int, out: Path, model_name: str) -> Exported:
    """Write conversation `conversation_id`'s whole saved cache to `out`."""
    entry = kvstore.index.conversation(conversation_id)
    if entry is None:
        raise ExportFailed(f"conversation {conversation_id} has no saved cache")
    result = kvstore.restore(entry, len(entry.tokens))
    if result.cache is None:
        raise ExportFailed(f"the saved cache cannot be used: {result.rejected}")
    kvstore.index.touch(entry.all_keys)  # read: used, for eviction as a turn's restore is
    layers = [as_mlx_lm(layer) for layer in result.cache]
    path = export_path(out)
    metadata = {
        "model": model_name,
        "reprise_conversation_id": str(conversation_id),
        "tokens": json.dumps(result.tokens),
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_prompt_cache(str(path), layers, metadata)
    except (OSError, RuntimeError) as exc:  # mlx reports a failed write as RuntimeError
        raise ExportFailed(f"could not write {path}: {exc}") from exc
    converted = sum(
        isinstance(part, MixedKVCache)
        for layer in result.cache
        for part in getattr(layer, "caches", (layer,))
    )
    return Exported(path, len(result.tokens), converted)


def as_mlx_lm(layer):
    """`layer` as one of mlx-lm's own cache classes."""
    if type(layer) is CacheList:  # a new list: the restored cache stays as it was
        return CacheList(*(as_mlx_lm(part) for part in layer.caches))
    if not isinstance(layer, MixedKVCache):
        return layer
    keys, values = layer.dequantized()
    if isinstance(layer, ChunkedMixedKVCache):
        chunked = ChunkedKVCache(layer.chunk_size)
        chunked.keys, chunked.values = keys, values
        chunked.offset, chunked.start_position = layer.offset, layer.start_position
        return chunked
    if layer.max_size is None:
        plain = KVCache()
        plain.keys, plain.values, plain.offset = keys, values, keys.shape[2]
        return plain
    rotating = RotatingKVCache(max_size=layer.max_size, keep=layer.keep)
    rotating.keys, rotating.values = keys, values
    rotating.offset, rotating._idx = layer.offset, keys.shape[2]
    mx.eval(keys, values)
    return rotating
