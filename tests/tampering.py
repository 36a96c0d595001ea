"""Hostile edits to a saved cache file that keep it signed, so that what refuses it
is the check of what the edit changed, not the checksum."""

from __future__ import annotations

import json
from collections.abc import Callable

from sessions.cachefiles import CacheIndex, path_from_url, read_file, write_file


def rewrite_layout(index: CacheIndex, key: str, change: Callable[[list], object]) -> None:
    """Apply `change` to the JSON layout of chunk `key`'s file (a checkpoint's layer
    list) and write the file back with a fresh checksum."""
    path = path_from_url(index.chunk(key)["url"])
    tensors, metadata = read_file(path, {})
    layout = json.loads(metadata["layout"])
    change(layout)
    metadata["layout"] = json.dumps(layout)
    write_file(path, tensors, {k: v for k, v in metadata.items() if k != "checksum"})
