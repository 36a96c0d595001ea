"""Whole-cache snapshots for models whose cache cannot be cut into chunks.

Sliding-window layers (`RotatingKVCache`) overwrite old positions and
recurrent layers (`ArraysCache`) hold a running state, so neither can be split
along the token axis. Such caches are saved whole after each turn (a message
boundary), with the same checks as chunks, and restored only when the saved
tokens are an exact prefix of the new prompt.

A layer's `state` is a tuple of arrays, tuples of arrays and plain values; the
layout in the file's metadata records which is which. Restoring sets the state
on the model's own fresh cache objects, so a class is never looked up by name:
the file's class names must match the model's.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

from app.engine.kvquant import MixedKVCache
from app.engine.kvscheme import SIXTEEN_BIT
from app.engine.stored_arrays import check_dtype, from_stored, to_numpy
from sessions.cachefiles import CacheRejected

CHUNKABLE = (KVCache, QuantizedKVCache, MixedKVCache)
# Classes a snapshot may hold; KVCache and RotatingKVCache layers may have been quantized.
SNAPSHOT_CLASSES = {
    "KVCache": KVCache,
    "QuantizedKVCache": QuantizedKVCache,
    "MixedKVCache": MixedKVCache,
    "RotatingKVCache": RotatingKVCache,
    "ArraysCache": ArraysCache,
}
_QUANTIZABLE = (KVCache, RotatingKVCache)


def is_chunkable(cache: list) -> bool:
    return all(
        type(layer) in CHUNKABLE and getattr(layer, "max_size", None) is None for layer in cache
    )


def snapshot(cache: list) -> tuple[dict[str, np.ndarray], str]:
    """The cache's tensors by name, and the JSON layout that puts them back."""
    tensors: dict[str, np.ndarray] = {}
    layout = []
    for i, layer in enumerate(cache):
        items = []
        state = layer.state
        if type(layer) is KVCache:  # its buffers run past `offset`: keep what is used
            state = (
                layer.keys[..., : layer.offset, :],
                layer.values[..., : layer.offset, :],
                layer.offset,
            )
        for n, item in enumerate(state):
            if isinstance(item, mx.array):
                tensors[f"{i}.{n}"] = to_numpy(item)
                items.append(["array", f"{i}.{n}"])
            elif isinstance(item, tuple | list) and item and isinstance(item[0], mx.array):
                names = [f"{i}.{n}.{m}" for m in range(len(item))]
                tensors.update({name: to_numpy(a) for name, a in zip(names, item, strict=True)})
                items.append(["arrays", names])
            elif item is None or isinstance(item, int | float | str | bool):
                items.append(["value", item])
            else:
                raise TypeError(f"cannot snapshot {type(layer).__name__} state item {type(item)}")
        layout.append({"class": type(layer).__name__, "items": items})
    return tensors, json.dumps(layout)


def _array(tensors: dict[str, mx.array], name: str) -> mx.array:
    if name not in tensors:
        raise CacheRejected(f"tensor {name} is missing")
    check_dtype(tensors[name].dtype, name)
    return from_stored(tensors[name])


def restore(template: list, tensors: dict[str, mx.array], layout_json: str) -> list:
    """Put a snapshot back into the model's fresh cache objects `template`."""
    try:
        layout = json.loads(layout_json)
    except ValueError as exc:
        raise CacheRejected("unreadable snapshot layout") from exc
    if len(layout) != len(template):
        raise CacheRejected("layer count does not match the model")
    used = set()
    cache = []
    for layer, spec in zip(template, layout, strict=True):
        name = spec.get("class")
        if name not in SNAPSHOT_CLASSES:
            raise CacheRejected(f"unknown cache class {name!r}")
        if name == "QuantizedKVCache" and type(layer) is KVCache:
            layer = QuantizedKVCache()
        elif name == "MixedKVCache" and type(layer) in _QUANTIZABLE:
            layer = MixedKVCache(SIXTEEN_BIT)  # the state names its scheme
        elif name != type(layer).__name__:
            raise CacheRejected(f"a {name} layer where the model has {type(layer).__name__}")
        state = []
        for kind, value in spec["items"]:
            if kind == "array":
                state.append(_array(tensors, value))
                used.add(value)
            elif kind == "arrays":
                state.append(tuple(_array(tensors, v) for v in value))
                used.update(value)
            elif kind == "value":
                state.append(value)
            else:
                raise CacheRejected(f"unknown snapshot item {kind!r}")
        keys = state[0][0] if isinstance(state[0], tuple) else state[0]
        if name not in ("ArraysCache", "MixedKVCache") and keys.ndim != 4:
            raise CacheRejected(f"a {name} layer with the wrong shape {keys.shape}")
        try:
            layer.state = tuple(state) if name != "ArraysCache" else state
        except (ValueError, TypeError) as exc:
            raise CacheRejected(f"a {name} layer does not take this state ({exc})") from exc
        cache.append(layer)
    if used != set(tensors):
        raise CacheRejected("tensor count does not match the layout")
    return cache
