"""Hostile edits to a saved cache file that keep it signed, so that what refuses it
is the check of what the edit changed, not the checksum; and files as an earlier
Reprise wrote them."""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np

from sessions.cachefiles import CacheIndex, path_from_url, read_file, write_file
from sessions.chunkio import FORMAT_KEY
from sessions.safetensors_header import CHECKSUM_KEY, as_bytes, digest, encode_header, layout


def rewrite_layout(index: CacheIndex, key: str, change: Callable[[list], object]) -> None:
    """Apply `change` to the JSON layout of chunk `key`'s file (a checkpoint's layer
    list) and write the file back with a fresh checksum."""
    path = path_from_url(index.chunk(key)["url"])
    tensors, metadata = read_file(path, {})
    layout = json.loads(metadata["layout"])
    change(layout)
    metadata["layout"] = json.dumps(layout)
    write_file(path, tensors, {k: v for k, v in metadata.items() if k != "checksum"})


def rewrite_chunk(index: CacheIndex, key: str, change: Callable[[dict, dict], object]) -> None:
    """Apply `change` to the tensors (name -> numpy array) and the metadata of chunk
    `key`'s file and write it back with a fresh checksum, and its row with the new size."""
    path = path_from_url(index.chunk(key)["url"])
    tensors, metadata = read_file(path, {})
    tensors, metadata = dict(tensors), {k: v for k, v in metadata.items() if k != "checksum"}
    change(tensors, metadata)
    size = write_file(path, tensors, metadata)
    _set_size(index, key, size)


def as_format_3(index: CacheIndex, key: str) -> None:
    """Write chunk `key`'s file again as Reprise wrote it before format 4: one tensor
    per layer ("1.k.0", where format 4 stacks "0-1.k.0"), stamped "3", signed."""
    as_format(index, key, "3")


def as_format(index: CacheIndex, key: str, version: str) -> None:
    """Chunk `key`'s file with one tensor per layer, stamped `version`, signed."""
    path = path_from_url(index.chunk(key)["url"])
    tensors, metadata = read_file(path, {})
    per_layer = {}
    for name, array in tensors.items():
        span, _, part = name.partition(".")
        first, last = (int(n) for n in span.split("-"))
        for i in range(first, last + 1):
            per_layer[f"{i}.{part}"] = np.ascontiguousarray(array[i - first])
    meta = {k: v for k, v in metadata.items() if k not in (CHECKSUM_KEY, FORMAT_KEY)}
    meta[FORMAT_KEY] = version
    specs = layout(per_layer)
    meta[CHECKSUM_KEY] = digest(specs, meta, (as_bytes(per_layer[t.name]) for t in specs))
    header = encode_header(specs, meta)
    path.write_bytes(header + b"".join(as_bytes(per_layer[t.name]).tobytes() for t in specs))
    _set_size(index, key, path.stat().st_size)


def _set_size(index: CacheIndex, key: str, size: int) -> None:
    with index.db.conn:
        index.db.execute("update cache_chunks set bytes = ? where key = ?", [size, key])
