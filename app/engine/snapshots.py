"""Snapshots of the cache layers that cannot be cut into chunks: the checkpoint file.

Sliding-window layers (`RotatingKVCache`) overwrite old positions and
recurrent layers (`ArraysCache`) hold a running state, so neither can be split
along the token axis. Their state is saved after each turn (a message
boundary), with the same checks as chunks; the cache's full-attention layers,
which token chunks hold (app.engine.checkpoints), are only named in the layout
("in_chunks"), and come back from the chunks into their places. A CacheList's
parts are saved and restored each in its place; a part's slot counts as
`cache_keys.cache_parts` does. A snapshot with no "in_chunks" layer is a whole
cache (as every snapshot was before checkpoints).

A layer's `state` is a tuple of arrays, tuples of arrays and plain values; the
layout in the file's metadata records which is which. Restoring sets the state
on the model's own fresh cache objects, so a class is never looked up by name:
the file's class names must match the model's.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from app.engine.cache_keys import cache_parts
from app.engine.kvchunked import ChunkedMixedKVCache
from app.engine.kvquant import MixedKVCache
from app.engine.kvscheme import SIXTEEN_BIT
from app.engine.stored_arrays import check_dtype, from_stored, to_numpy
from sessions.cachefiles import CacheRejected

CHUNKABLE = (KVCache, QuantizedKVCache, MixedKVCache)
# Classes a snapshot may hold; KVCache, RotatingKVCache and ChunkedKVCache layers may
# have been quantized.
SNAPSHOT_CLASSES = {
    "KVCache": KVCache,
    "QuantizedKVCache": QuantizedKVCache,
    "MixedKVCache": MixedKVCache,
    "ChunkedMixedKVCache": ChunkedMixedKVCache,
    "RotatingKVCache": RotatingKVCache,
    "ChunkedKVCache": ChunkedKVCache,
    "ArraysCache": ArraysCache,
    "CacheList": CacheList,
}
_QUANTIZABLE = (KVCache, RotatingKVCache)
# Classes a checkpoint may leave to token chunks (the codecs' classes, app.engine.codecs).
_IN_CHUNKS = ("KVCache", "MixedKVCache")
# Sizes a layer takes from the model's config: a snapshot must agree with them.
_MODEL_SIZES = ("max_size", "keep", "chunk_size")
# Layers whose state names their KV format (a string, parsed by their own setter).
_NAMES_FORMAT = ("MixedKVCache", "ChunkedMixedKVCache")
# Layers whose first state item is their keys, one array per head and token.
_ATTENTION = ("KVCache", "QuantizedKVCache", "RotatingKVCache", "ChunkedKVCache")
# Layers whose first two state items are their keys and values, plain arrays.
_WINDOWS = ("RotatingKVCache", "ChunkedKVCache")


def is_chunkable(cache: list) -> bool:
    return all(
        type(layer) in CHUNKABLE and getattr(layer, "max_size", None) is None for layer in cache
    )


def can_trim(cache: list) -> bool:
    """Whether every layer can be cut back to an earlier token. mlx-lm's
    ChunkedKVCache says it can, but once it has dropped its front a cut cannot
    bring those tokens back."""
    for layer in cache:
        for part in getattr(layer, "caches", (layer,)):
            if not part.is_trimmable() or getattr(part, "start_position", 0) > 0:
                return False
    return True


def _used_state(layer) -> tuple | list:
    """The layer's state without the unused tail of its preallocated buffers."""
    if type(layer) is KVCache and layer.keys is not None:
        return (
            layer.keys[..., : layer.offset, :],
            layer.values[..., : layer.offset, :],
            layer.offset,
        )
    if type(layer) is ChunkedKVCache and layer.keys is not None:
        keys, values = layer.keys_and_values()
        return (keys, values, layer.offset, layer.chunk_size, layer.start_position)
    return layer.state


@dataclass
class _Saving:
    """What a snapshot being written needs as it walks the layers."""

    tensors: dict[str, np.ndarray]
    slots: Iterator[int]  # each part's slot, counted as `cache_parts` does
    in_chunks: set[int]  # the slots token chunks hold
    store_as: mx.Dtype | None  # the 16-bit type float32 windows are saved in


def _layer_layout(layer, prefix: str, saving: _Saving) -> dict:
    """One layer's layout entry, its arrays added to `saving.tensors` under `prefix`; a
    part whose slot is `in_chunks` is only named: token chunks hold it."""
    if type(layer) is CacheList:
        parts = [_layer_layout(p, f"{prefix}.{m}", saving) for m, p in enumerate(layer.caches)]
        return {"class": "CacheList", "parts": parts}
    name = type(layer).__name__
    if next(saving.slots) in saving.in_chunks:
        return {"class": name, "in_chunks": True}
    state = _used_state(layer)
    narrowed = _narrowed(name, state, saving.store_as)
    items = [_item(item, f"{prefix}.{n}", name, saving.tensors) for n, item in enumerate(narrowed)]
    if narrowed is not state:  # say so, and the restore computes in float32 again
        return {"class": name, "items": items, "computed_in": "float32"}
    return {"class": name, "items": items}


def _narrowed(name: str, state, store_as: mx.Dtype | None):
    """A window's state with its float32 keys and values in `store_as`: as chunks
    hold a float32 cache of a 16-bit model (`codecs.stored_format`), half the bytes."""
    if store_as is None or name not in _WINDOWS or not isinstance(state[0], mx.array):
        return state
    if state[0].dtype != mx.float32:
        return state
    return (state[0].astype(store_as), state[1].astype(store_as), *state[2:])


def _item(item, name: str, layer: str, tensors: dict[str, np.ndarray]) -> list:
    """One state item's layout entry, its arrays added to `tensors` under `name`."""
    if isinstance(item, mx.array):
        tensors[name] = to_numpy(item)
        return ["array", name]
    if isinstance(item, tuple | list) and any(isinstance(a, mx.array) for a in item):
        names = []
        for m, array in enumerate(item):  # an ArraysCache slot may still be empty
            if array is None:
                names.append(None)
            elif isinstance(array, mx.array):
                tensors[f"{name}.{m}"] = to_numpy(array)
                names.append(f"{name}.{m}")
            else:
                raise TypeError(f"cannot snapshot {layer} item {type(array)}")
        return ["arrays", names]
    if item is None or isinstance(item, int | float | str | bool):
        return ["value", item]
    if isinstance(item, tuple | list) and all(a is None for a in item):
        return ["arrays", [None] * len(item)]
    raise TypeError(f"cannot snapshot {layer} state item {type(item)}")


def snapshot(
    cache: list, in_chunks: Collection[int] = (), store_as: mx.Dtype | None = None
) -> tuple[dict[str, np.ndarray], str]:
    """The cache's tensors by name, and the JSON layout that puts them back; the parts
    whose slots are `in_chunks` (token chunks hold them) are named, not saved, and
    float32 windows are saved in `store_as` when given."""
    saving = _Saving({}, iter(range(len(cache_parts(cache)))), set(in_chunks), store_as)
    layout = [_layer_layout(layer, str(i), saving) for i, layer in enumerate(cache)]
    return saving.tensors, json.dumps(layout)


def put_part(cache: list, slot: int, part) -> None:
    """Put `part` in `cache` at `slot` (counted as `cache_parts` does)."""
    for i, layer in enumerate(cache):
        count = len(getattr(layer, "caches", (layer,)))
        if slot >= count:
            slot -= count
        elif type(layer) is CacheList:
            layer.caches = (*layer.caches[:slot], part, *layer.caches[slot + 1 :])
            return
        else:
            cache[i] = part
            return
    raise IndexError("no such slot")


def _array(tensors: dict[str, mx.array], name: str) -> mx.array:
    if not isinstance(name, str) or name not in tensors:
        raise CacheRejected(f"tensor {name} is missing")
    check_dtype(tensors[name].dtype, name)
    return from_stored(tensors[name])


def restore(template: list, tensors: dict[str, mx.array], layout_json: str) -> list:
    """Put a whole snapshot back into the model's fresh cache objects `template`."""
    cache, in_chunks = restore_checkpoint(template, tensors, layout_json)
    if in_chunks:
        raise CacheRejected("a snapshot that leaves layers to token chunks")
    return cache


def restore_checkpoint(
    template: list, tensors: dict[str, mx.array], layout_json: str, shapes: list | None = None
) -> tuple[list, dict[int, str]]:
    """Put a checkpoint back into the model's fresh cache objects `template`; the parts
    token chunks hold stay fresh, and come back as {slot: class the layout names}.
    `shapes`: the model's `attention_shapes`, which every attention layer must match."""
    try:
        layout = json.loads(layout_json)
    except ValueError as exc:
        raise CacheRejected("unreadable snapshot layout") from exc
    if not isinstance(layout, list) or len(layout) != len(template):
        raise CacheRejected("layer count does not match the model")
    restored = _Restored(tensors, shapes)
    cache = [restored.layer(layer, spec) for layer, spec in zip(template, layout, strict=True)]
    if restored.used != set(tensors):
        raise CacheRejected("tensor count does not match the layout")
    return cache, restored.in_chunks


class _Restored:
    """What a checkpoint restore has met so far: tensors used, parts left to chunks."""

    def __init__(self, tensors: dict[str, mx.array], shapes: list | None) -> None:
        self.tensors, self.used, self.shapes = tensors, set(), shapes
        self.in_chunks: dict[int, str] = {}
        self.slot = 0

    def layer(self, layer, spec):
        """`layer` (the model's fresh one) as `spec` has it, a CacheList's parts each."""
        name = spec.get("class") if isinstance(spec, dict) else None
        if not isinstance(name, str):  # a layout is read from a file: any JSON at all
            raise CacheRejected("a snapshot layer without a class name")
        if name == "CacheList" and type(layer) is CacheList:
            parts = spec.get("parts")
            if not isinstance(parts, list) or len(parts) != len(layer.caches):
                raise CacheRejected("a CacheList layer with the wrong number of parts")
            layer.caches = tuple(self.layer(p, s) for p, s in zip(layer.caches, parts, strict=True))
            return layer
        slot, self.slot = self.slot, self.slot + 1
        if isinstance(spec, dict) and spec.get("in_chunks") is True:
            # Chunks hold only full-attention layers, and the fresh model layer is one.
            if name not in _IN_CHUNKS or type(layer) is not KVCache:
                raise CacheRejected(f"a {name} layer left to chunks where the model has none")
            self.in_chunks[slot] = name
            return layer
        restored = _restore_layer(layer, name, spec, self.tensors, self.used)
        if self.shapes is not None:
            _check_shape(name, restored, self.shapes[slot][1])
        return restored


def _restore_layer(layer, name, spec: dict, tensors: dict[str, mx.array], used: set[str]):
    """One part (never a CacheList) put back into the model's fresh `layer`."""
    sizes = {"max_size": None} | {k: getattr(layer, k) for k in _MODEL_SIZES if hasattr(layer, k)}
    if name not in SNAPSHOT_CLASSES:
        raise CacheRejected(f"unknown cache class {name!r}")
    if name == "QuantizedKVCache" and type(layer) is KVCache:
        layer = QuantizedKVCache()
    elif name == "MixedKVCache" and type(layer) in _QUANTIZABLE:
        layer = MixedKVCache(SIXTEEN_BIT)  # the state names its scheme
    elif name == "ChunkedMixedKVCache" and type(layer) is ChunkedKVCache:
        layer = ChunkedMixedKVCache(SIXTEEN_BIT, layer.chunk_size)  # and its chunk size
    elif name != type(layer).__name__:
        raise CacheRejected(f"a {name} layer where the model has {type(layer).__name__}")
    state = _state_items(spec.get("items"), tensors, used, text=name in _NAMES_FORMAT)
    if name in _ATTENTION:
        keys = state[0][0] if isinstance(state[0], tuple) else state[0]
        if not isinstance(keys, mx.array) or keys.ndim != 4:
            raise CacheRejected(
                f"a {name} layer with the wrong keys {getattr(keys, 'shape', keys)}"
            )
    if "computed_in" in spec:
        state = _widened(name, state, spec["computed_in"])
    if name == "ArraysCache":
        slots = state[0] if state else None
        if not isinstance(slots, tuple) or len(slots) != len(layer.cache):
            raise CacheRejected("an ArraysCache layer with the wrong number of arrays")
        state[0] = list(slots)  # the model assigns into it
    try:
        layer.state = tuple(state)
    except (ValueError, TypeError, AttributeError, IndexError) as exc:  # text for an array
        raise CacheRejected(f"a {name} layer does not take this state ({exc})") from exc
    _check_counts(name, layer)
    for size, value in sizes.items():  # the model's window, kept tokens or chunk size
        if getattr(layer, size, None) != value:
            raise CacheRejected(f"a {name} layer with another {size} than the model's")
    return layer


def _check_shape(name: str, layer, expected) -> None:
    """A restored attention layer holds what the model's does per token (heads, key and
    value widths; `expected` from `attention_shapes`), in arrays of the types its class
    keeps: otherwise the next turn would fail inside the model, or read nonsense."""
    held = _held_shape(layer)
    if held is None:
        return
    if expected is None or held != (expected.heads, expected.key_dim, expected.value_dim):
        raise CacheRejected(f"a {name} layer shaped {held} where the model's is another")


def _held_shape(layer) -> tuple[int, int, int] | None:
    """(heads, key width, value width) of what `layer` holds; None for a layer that holds
    no keys (a recurrent state, a part left to chunks)."""
    if isinstance(layer, MixedKVCache):
        return _mixed_shape(layer)
    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
    if not isinstance(keys, mx.array) or not isinstance(values, mx.array):
        return None
    return keys.shape[1], keys.shape[3], values.shape[3]


def _mixed_shape(layer: MixedKVCache) -> tuple[int, int, int] | None:
    """Heads and widths of a `MixedKVCache`, every buffer of both halves agreeing (4-D,
    batch 1, 16-bit rows in a 16-bit type, codes as uint32)."""
    heads, widths = set(), []
    for part in (0, 1):
        found = set()
        for store in (layer.bulk[part], layer.exact[part]):
            for i, buffer in enumerate(store.buffers):
                if buffer.ndim != 4 or buffer.shape[0] != 1:
                    raise CacheRejected("a MixedKVCache layer with arrays of the wrong rank")
                codes = store.bits is not None and i == 0
                wanted = (mx.uint32,) if codes else (mx.float16, mx.bfloat16)
                if buffer.dtype not in wanted:
                    raise CacheRejected(f"a MixedKVCache layer holding {buffer.dtype}")
                heads.add(buffer.shape[1])
                if i == 0:
                    found.add(buffer.shape[3] * 32 // store.bits if codes else buffer.shape[3])
        if len(found) > 1:
            raise CacheRejected("a MixedKVCache layer whose rows differ in width")
        widths.append(found.pop() if found else None)
    if len(heads) > 1:
        raise CacheRejected("a MixedKVCache layer whose rows differ in heads")
    if not heads or None in widths:
        return None
    return heads.pop(), widths[0], widths[1]


# A layer's counts and sizes: a setter takes whatever the state holds, and an array (or
# a string) there only fails later, at the next token inside the model.
_COUNTS = ("offset", "_idx", "start_position", *_MODEL_SIZES)


def _check_counts(name: str, layer) -> None:
    """Counts are ints mlx can slice with (32 bits), and agree with the keys held."""
    for count in _COUNTS:
        value = getattr(layer, count, 0)
        if value is None and count == "max_size":
            continue
        if type(value) is not int or not 0 <= value < 2**31:
            raise CacheRejected(f"a {name} layer whose {count.strip('_')} is not a count")
    keys = getattr(layer, "keys", None)
    held = keys.shape[2] if isinstance(keys, mx.array) else 0
    if type(layer) is KVCache and layer.offset != held:
        raise CacheRejected(f"a {name} layer whose offset is not its keys' length")
    if type(layer) is RotatingKVCache and not layer._idx <= held <= layer.offset:
        raise CacheRejected(f"a {name} layer whose position is outside its keys")


def _widened(name: str, state: list, computed_in: object) -> list:
    """A window saved in 16 bits (`_narrowed`) back in float32, the type it computes in."""
    if computed_in != "float32" or name not in _WINDOWS:
        raise CacheRejected(f"a {name} layer computed in {computed_in!r}")
    if not all(isinstance(a, mx.array) and a.dtype != mx.float32 for a in state[:2]):
        raise CacheRejected(f"a {name} layer whose 16-bit keys are not")
    return [state[0].astype(mx.float32), state[1].astype(mx.float32), *state[2:]]


def _state_items(items, tensors: dict[str, mx.array], used: set[str], text: bool) -> list:
    if not isinstance(items, list) or not items:
        raise CacheRejected("a snapshot layer without a state")
    state: list = []
    for entry in items:
        if not isinstance(entry, list) or len(entry) != 2:
            raise CacheRejected("unreadable snapshot item")
        kind, value = entry
        if kind == "array":
            state.append(_array(tensors, value))
            used.add(value)
        elif kind == "arrays" and isinstance(value, list):
            state.append(tuple(None if v is None else _array(tensors, v) for v in value))
            used.update(v for v in value if v is not None)
        elif kind == "value" and _plain_value(value, text):
            state.append(value)
        else:
            raise CacheRejected(f"unknown snapshot item {kind!r}")
    return state


def _plain_value(value, text: bool) -> bool:
    """What a layer's state may hold besides arrays: counts and sizes (never negative),
    None, and (`text`) MixedKVCache's format name, which its own setter parses."""
    if value is None or (text and isinstance(value, str)):
        return True
    return type(value) is int and value >= 0
