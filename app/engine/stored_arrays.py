"""How KV arrays are written to and read from cache files.

numpy (which safetensors writes from) has no bfloat16, so bfloat16 arrays are
stored as their raw 16 bits (uint16) and viewed back on reading. Only the
dtypes a KV cache can hold are accepted from a file.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from sessions.cachefiles import CacheRejected

_STORED_DTYPES = (mx.float32, mx.float16, mx.uint32, mx.uint16)


def to_numpy(array: mx.array) -> np.ndarray:
    if array.dtype == mx.bfloat16:
        return np.array(array.view(mx.uint16))
    return np.array(array)


def check_dtype(dtype: mx.Dtype, name: str = "a tensor") -> None:
    if dtype not in _STORED_DTYPES:
        raise CacheRejected(f"{name} has an unsupported dtype {dtype}")


def from_stored(array: mx.array) -> mx.array:
    return array.view(mx.bfloat16) if array.dtype == mx.uint16 else array


def load_mlx(path: Path) -> tuple[dict[str, mx.array], dict[str, str]]:
    """Read a cache file straight into mlx memory (cheaper here than fresh numpy buffers)."""
    tensors, metadata = mx.load(str(path), return_metadata=True)
    mx.eval(list(tensors.values()))
    return tensors, metadata
