"""CPU probe behind the README's note on the warm restore's floor (issue 14, thirteenth
session; the ideas tried were not kept): a chat of about TOKENS tokens (the starter's
16-bit cache) is saved, then, ROUNDS times in one process and alternated, each of:

    read            each file read whole into a new buffer, dropped at once (the plain
                    read `bench reopen` sets a restore against: one freed buffer, reused)
    read, kept      the same, every file's bytes kept until all are read (as a restore
                    must keep the cache: its memory is new, and touched for the first time)
    restore         the app's restore (`KVStore.restore`)
    restore, unfilled layers
                    the same, with the layers' buffers made by mlx's own loader from a
                    reader that writes nothing into them: mlx allocates, fills nothing
    rows in place (zeros | unfilled)
                    each file's rows read straight into the layers' rows (`os.preadv`,
                    a call per tensor and layer), checksummed piece by piece in file order
                    while they are in the processor's cache; no index, no checks but the
                    checksum (what the app adds to it costs about 2-4 ms more)

Medians, in milliseconds, and each against the plain read.

    .venv/bin/python docs/probes/warm_restore_floor_probe.py MODEL_DIR [TOKENS] [ROUNDS]

Everything happens in a temporary folder.
"""

import gc
import io
import os
import statistics
import sys
import tempfile
import time

folder = tempfile.mkdtemp()
for name in ("DATA", "CACHE", "CONFIG"):
    os.environ[f"REPRISE_{name}_DIR"] = os.path.join(folder, name.lower())

import numpy as np  # noqa: E402
import xxhash  # noqa: E402

from app.bench.reopen import saved_chat  # noqa: E402
from app.engine import chunkjoin, loading  # noqa: E402  (app.engine first: OpenBLAS)
from sessions.chunkio import parse_header  # noqa: E402
from sessions.safetensors_header import (  # noqa: E402
    CHECKSUM_KEY,
    CHECKSUM_PREFIX,
    DTYPES,
    TensorSpec,
    _canonical,
    dtype_code,
    encode_header,
)

mx = loading.mx  # mlx as the app loaded it, after OpenBLAS
STEP = 256  # room for the next tokens, as the app's layers have


class _WritesNothing(io.RawIOBase):
    """A safetensors file of `specs` whose data reads leave the buffer as it is."""

    def __init__(self, specs: list[TensorSpec]) -> None:
        super().__init__()
        self.header = encode_header(specs, {})
        self.size, self.position = len(self.header) + specs[-1].end, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence]
        self.position = base + offset
        return self.position

    def readinto(self, buffer) -> int:
        count = memoryview(buffer).nbytes
        if self.position < len(self.header):
            count = min(count, len(self.header) - self.position)
            buffer[:count] = self.header[self.position : self.position + count]
        self.position += count
        return count


def unfilled(count: int, shape: tuple, dtype: np.dtype) -> list:
    code, size = dtype_code(np.dtype(dtype)), int(np.prod(shape)) * np.dtype(dtype).itemsize
    specs = [TensorSpec(f"{i:05d}", code, shape, i * size, (i + 1) * size) for i in range(count)]
    arrays = mx.load(_WritesNothing(specs), format="safetensors")
    return [arrays[spec.name] for spec in specs]


def unfilled_layers(count, shape, capacity, dtype):  # chunkjoin.empty_layers, unfilled
    layers = unfilled(count, (*shape[:2], capacity, shape[3]), dtype)
    return [(layer, np.asarray(layer)) for layer in layers]


def zeros(count: int, shape: tuple, dtype: np.dtype) -> list:
    kind = mx.float16 if dtype == np.float16 else mx.float32
    layers = [mx.zeros(shape, kind) for _ in range(count)]
    mx.eval(layers)
    return layers


def rows_in_place(files: list, make) -> dict:
    opened = []
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        with open(fd, "rb", closefd=False) as f:
            opened.append((fd, parse_header(f, os.fstat(fd).st_size)))
    first = opened[0][1].tensors[0]
    layers_, batch, heads, _, width = first.shape
    tokens = sum(header.tensors[0].shape[3] for _, header in opened)
    capacity, row = (tokens // STEP + 1) * STEP, width * DTYPES[first.dtype].itemsize
    shape, dtype = (batch, heads, capacity, width), DTYPES[first.dtype]
    layers = {t.name: make(layers_, shape, dtype) for t in opened[0][1].tensors}
    views = {
        name: [memoryview(np.asarray(a).reshape(-1).view(np.uint8)) for a in arrays]
        for name, arrays in layers.items()
    }
    start = 0
    for fd, header in opened:
        count = header.tensors[0].shape[3]
        piece = batch * heads * count * row
        hasher = xxhash.xxh3_64(_canonical(header.tensors, header.metadata))
        for tensor in header.tensors:
            for i in range(layers_):
                view = views[tensor.name][i]
                rows = [
                    view[(h * capacity + start) * row : (h * capacity + start + count) * row]
                    for h in range(batch * heads)
                ]
                if os.preadv(fd, rows, header.data_start + tensor.begin + i * piece) != piece:
                    raise ValueError("a short read")
                for part in rows:
                    hasher.update(part)
        if CHECKSUM_PREFIX + hasher.hexdigest() != header.metadata[CHECKSUM_KEY]:
            raise ValueError("checksum mismatch")
        os.close(fd)
        start += count
    for parts in views.values():
        for view in parts:
            np.frombuffer(view, np.uint8).reshape(batch * heads, -1)[:, tokens * row :] = 0
    return layers


def main() -> None:
    loaded = loading.load(sys.argv[1])
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 15
    entry, files, store = saved_chat(loaded, tokens)
    size = sum(f.stat().st_size for f in files)
    made_by_the_app = chunkjoin.empty_layers

    def restore_unfilled():
        chunkjoin.empty_layers = unfilled_layers
        try:
            return store.restore(entry, len(entry.tokens))
        finally:
            chunkjoin.empty_layers = made_by_the_app

    ways = {
        "read": lambda: [len(f.read_bytes()) for f in files],  # each buffer dropped at once
        "read, kept": lambda: [f.read_bytes() for f in files],
        "restore": lambda: store.restore(entry, len(entry.tokens)),
        "restore, unfilled layers": restore_unfilled,
        "rows in place (zeros)": lambda: rows_in_place(files, zeros),
        "rows in place (unfilled)": lambda: rows_in_place(files, unfilled),
    }
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, way in ways.items():
            gc.collect()
            started = time.perf_counter()
            kept = way()
            seconds[name].append(time.perf_counter() - started)
            del kept
    print(f"{len(entry.tokens)} tokens, {len(files)} files, {size / 1e6:.1f} MB, {rounds} rounds")
    read = statistics.median(seconds["read"])
    for name, times in seconds.items():
        median = statistics.median(times)
        print(f"  {name:26} {median * 1e3:7.2f} ms  {median / read:4.1f}x the read")


if __name__ == "__main__":
    main()
