"""How KV arrays are written to and read from cache files.

numpy (which safetensors writes from) has no bfloat16, so bfloat16 arrays are
stored as their raw 16 bits (uint16) and viewed back on reading. Only the
dtypes a KV cache can hold are accepted from a file.

Where the GPU has memory of its own (mlx's CUDA build), a file is read and
checked in host memory and then copied to the device once (`to_device`): an
array loaded straight to the GPU and then read from the host, as the checksum
does, would be copied back into managed memory, which the GPU pulls in again
page by page.
"""

from __future__ import annotations

import bisect
import io
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np

from sessions.cachefiles import CacheRejected
from sessions.safetensors_header import TensorSpec, as_bytes, encode_header, layout

_STORED_DTYPES = (mx.float32, mx.float16, mx.uint32, mx.uint16)


def to_numpy(array: mx.array) -> np.ndarray:
    """`array` copied into host memory, bfloat16 as its raw bits.

    Where the GPU has memory of its own, mlx moves the whole buffer under an array
    into managed memory when the host reads it (mlx-cuda's `Buffer::raw_ptr`, a
    synchronous copy): a save's view of a turn's rows would take the layer's every
    row along, and the GPU would then compute on managed memory. A view is first
    copied on the device into an array of its own (`mx.contiguous` copies a view of
    part of a buffer; one within 16 kB of the whole buffer it shares, as good as)."""
    if device_apart():
        array = mx.contiguous(array)
    if array.dtype == mx.bfloat16:
        return np.array(array.view(mx.uint16))
    return np.array(array)


def check_dtype(dtype: mx.Dtype, name: str = "a tensor") -> None:
    if dtype not in _STORED_DTYPES:
        raise CacheRejected(f"{name} has an unsupported dtype {dtype}")


def from_stored(array: mx.array) -> mx.array:
    return array.view(mx.bfloat16) if array.dtype == mx.uint16 else array


_FROM_NUMPY = {
    np.dtype(t): m
    for t, m in (
        (np.float32, mx.float32),
        (np.float16, mx.float16),
        (np.uint32, mx.uint32),
        (np.uint16, mx.uint16),
    )
}


def stored_type(array) -> mx.Dtype | None:
    """The mlx type of a tensor read from a file: an mlx array's own, a numpy array's
    counterpart (None for a type no cache file holds)."""
    return array.dtype if isinstance(array.dtype, mx.Dtype) else _FROM_NUMPY.get(array.dtype)


def as_mlx(array) -> mx.array:
    """A tensor read from a file as an mlx array (numpy ones copied), bfloat16 as such."""
    return from_stored(array if isinstance(array, mx.array) else mx.array(array))


def empty_layers(
    count: int, shape: tuple[int, ...], capacity: int, dtype: np.dtype
) -> list[tuple[mx.array, np.ndarray]]:
    """`count` new mlx arrays of `shape` (batch, heads, tokens, width) with `capacity`
    tokens, zeros, each with a numpy view to copy a restore's chunks into (writable,
    and held by nothing else: they were just made). A layer's own buffer, not a view
    of one buffer of its run: a view is not mlx's to update in place, so the first
    token after a restore would copy every layer."""
    batch, heads, _, width = shape
    layers = [
        mx.zeros((batch, heads, capacity, width), _FROM_NUMPY[np.dtype(dtype)])
        for _ in range(count)
    ]
    mx.eval(layers)
    return [(layer, np.asarray(layer)) for layer in layers]


def in_mlx(arrays: dict[str, np.ndarray]) -> dict[str, mx.array]:
    """Checked host arrays as mlx arrays: in the GPU's memory where it has its own
    (`to_device`), copied into mlx's elsewhere."""
    if device_apart():
        return to_device(arrays)
    return {name: mx.array(array) for name, array in arrays.items()}


def read_in_threads(read: Callable, calls: list[tuple], ahead: int) -> Iterator:
    """`read(*args)` for each of `calls`, in order, run by `ahead` threads at most that
    many calls ahead of the one yielded. A failure is raised when its turn comes; the
    calls not started by then never are (those under way finish first)."""
    with ThreadPoolExecutor(ahead) as pool:
        todo = iter(calls)
        pending = deque(pool.submit(read, *args) for args in itertools.islice(todo, ahead))
        try:
            while pending:
                done = pending.popleft()
                pending.extend(pool.submit(read, *args) for args in itertools.islice(todo, 1))
                yield done.result()
        finally:
            for future in pending:
                future.cancel()


def device_apart() -> bool:
    """Whether mlx computes in memory apart from the host's (its CUDA build, on the GPU)."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def to_device(arrays: dict[str, np.ndarray]) -> dict[str, mx.array]:
    """Checked host arrays in device memory, in one copy: mlx's own file loader reads
    them, as one run of bytes, from memory as if from a file, straight into device
    memory (`mx.array` would put each in managed memory, for the GPU to fault in page
    by page); each array is then a view of its bytes there."""
    if not arrays:
        return {}
    specs = layout(arrays)
    data = mx.load(_AsFile([as_bytes(arrays[spec.name]) for spec in specs]), format="safetensors")
    joined = data["bytes"]
    return {
        spec.name: joined[spec.begin : spec.end].view(_MLX_TYPES[spec.dtype]).reshape(spec.shape)
        for spec in specs
    }


_MLX_TYPES = {
    "F32": mx.float32,
    "F16": mx.float16,
    "U32": mx.uint32,
    "U16": mx.uint16,
    "U8": mx.uint8,
    "I32": mx.int32,
}


class _AsFile(io.RawIOBase):
    """A safetensors file of one uint8 tensor, "bytes", that is `parts` one after
    another, read in place: nothing is joined or copied until `readinto` copies it
    into the reader's buffer."""

    def __init__(self, parts: list[np.ndarray]) -> None:
        super().__init__()
        total = sum(part.nbytes for part in parts)
        spec = TensorSpec("bytes", "U8", (total,), 0, total)
        header = np.frombuffer(encode_header([spec], {}), dtype=np.uint8)
        self._parts = [header, *parts]
        self._starts = list(itertools.accumulate((p.nbytes for p in self._parts[:-1]), initial=0))
        self._size = header.nbytes + total
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, buffer) -> int:
        out = np.frombuffer(buffer, dtype=np.uint8)
        filled = 0
        while filled < out.nbytes and self._position < self._size:
            i = bisect.bisect_right(self._starts, self._position) - 1
            at = self._position - self._starts[i]
            piece = self._parts[i][at : at + out.nbytes - filled]
            out[filled : filled + piece.nbytes] = piece
            filled += piece.nbytes
            self._position += piece.nbytes
        return filled
