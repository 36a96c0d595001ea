"""GPU probe behind the README's note on the warm restore's copies to the device (issue 14,
thirteenth session; nothing here is kept in the app): 17 checked host files of 28 MB (a
4k-token Qwen3-1.7B cache) moved to the GPU, seven times each way, medians:

    to_device (now)          the app's way: per file, mlx's loader reads it from a Python
                             reader into memory it has just allocated, then copies that
                             to the device (mlx-cuda's `Load::eval_gpu`)
    split 4 MB / 1 MB        the same, each file as tensors of at most that size
    N threads, own streams   `to_device` from N threads, each with its own GPU stream
                             (the arrays are checked against what was sent)
    host copy only           the files copied into new host memory, no GPU at all

Run from the project root on the GPU machine (shared/tools/device-mlx-cuda.md):

    python3 docs/probes/h2d_ways_probe.py
"""

import statistics
import threading
import time

import numpy as np

from app.engine import stored_arrays  # first: it sets up mlx as the app does

mx = stored_arrays.mx
FILES, SIZE = 17, 28 << 20
NAMES = ("0-27.k.0", "0-27.v.0")
host = [
    {NAMES[0]: np.full(SIZE // 2, i, np.uint8), NAMES[1]: np.full(SIZE // 2, i + 1, np.uint8)}
    for i in range(FILES)
]


def check(out: list[dict]) -> None:
    sums = [int(mx.sum(a[n][:1024].astype(mx.uint32)).item()) for a in out for n in a]
    assert sums == [1024 * (i + j) for i in range(FILES) for j in (0, 1)], sums[:4]


def current() -> list[dict]:
    out = [stored_arrays.to_device(files) for files in host]
    mx.eval([a for o in out for a in o.values()])
    return out


def split(limit: int):
    def run() -> list[dict]:
        out = []
        for files in host:
            parts = {}
            for name, array in files.items():
                for i in range(0, array.nbytes, limit):
                    parts[f"{name}/{i:012d}"] = array[i : i + limit]
            moved = stored_arrays.to_device(parts)
            out.append(
                {
                    name: mx.concatenate([moved[k] for k in sorted(moved) if k.startswith(name)])
                    for name in files
                }
            )
        mx.eval([a for o in out for a in o.values()])
        return out

    return run


def threads(count: int):
    def run() -> list[dict]:
        out: list = [None] * FILES

        def work(first: int) -> None:
            with mx.stream(mx.new_stream(mx.gpu)):
                for i in range(first, FILES, count):
                    out[i] = stored_arrays.to_device(host[i])
                    mx.eval(list(out[i].values()))

        workers = [threading.Thread(target=work, args=(k,)) for k in range(count)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        return out

    return run


def host_copy() -> None:
    copies = [np.empty(SIZE, np.uint8) for _ in range(FILES)]
    for copy, files in zip(copies, host, strict=True):
        copy[: SIZE // 2] = files[NAMES[0]]
        copy[SIZE // 2 :] = files[NAMES[1]]


def main() -> None:
    ways = {
        "to_device (now)": current,
        "split 4 MB": split(4 << 20),
        "split 1 MB": split(1 << 20),
        "2 threads, own streams": threads(2),
        "4 threads, own streams": threads(4),
        "host copy only": host_copy,
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for round_ in range(7):
        for name, way in ways.items():
            started = time.perf_counter()
            out = way()
            times[name].append(time.perf_counter() - started)
            if out is not None and round_ == 0:
                check(out)
            del out
    for name, seconds in times.items():
        median = statistics.median(seconds)
        print(f"{name:26} {median * 1e3:7.1f} ms {FILES * SIZE / median / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
