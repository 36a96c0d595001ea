"""GPU probe behind the README's per-kernel and host-time figures (issue 13): decode
attention per step, 28 layers of a Qwen3-1.7B shape (8 KV heads, 16 query heads, head
size 128, bfloat16), mlx's 16-bit sdpa against the app's packed kernels. Run from the
project root on the GPU machine (shared/tools/device-mlx-cuda.md):

    python docs/probes/kv_attention_probe.py time 4096 16384 32768
        wall-clock per step (median of 7 x 50), the host's graph-building time alone,
        and 20 steps in one eval; VARIANTS="1:0,1:1" picks (stage_keys, compiled)
    ncu --clock-control none --metrics gpu__time_duration.sum -k regex:"reprise|sdpa" \
        --print-summary per-kernel python docs/probes/kv_attention_probe.py ncu 16384
        one step of each mode, for ncu to time every kernel on the device
"""

import os
import statistics
import sys
import time

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from app.engine import kvkernels
from app.engine.kvconvert import to_mixed
from app.engine.kvscheme import APP_SCHEMES

LAYERS, KVH, H, D = 28, 8, 16, 128


def base_layers(length):
    out = []
    for i in range(LAYERS):
        c = KVCache()
        k = mx.random.normal((1, KVH, length, D), key=mx.random.key(i)).astype(mx.bfloat16)
        v = mx.random.normal((1, KVH, length, D), key=mx.random.key(100 + i)).astype(mx.bfloat16)
        c.update_and_fetch(k, v)
        mx.eval(c.keys, c.values)
        out.append(c)
    return out


def steppers(length):
    base = base_layers(length)
    q = mx.random.normal((1, H, 1, D), key=mx.random.key(7)).astype(mx.bfloat16)
    reads = [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in base]
    mx.eval(reads)
    yield (
        "16-bit",
        lambda: [mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5) for k, v in reads],
    )
    for label, scheme in APP_SCHEMES.items():
        mixed = [to_mixed(c, scheme) for c in base]
        mx.eval([m.state for m in mixed])
        yield label, lambda mixed=mixed: [m.attend(q, D**-0.5, None) for m in mixed]
        del mixed


def timed(step, reps=50):
    for _ in range(5):
        mx.eval(step())
    walls, builds = [], []
    for _ in range(7):
        mx.synchronize()
        started = time.perf_counter()
        build = 0.0
        for _ in range(reps):
            t0 = time.perf_counter()
            out = step()
            build += time.perf_counter() - t0
            mx.eval(out)
        mx.synchronize()
        walls.append((time.perf_counter() - started) / reps)
        builds.append(build / reps)
    # many steps in one eval: the launch/eval overhead per step amortized
    mx.synchronize()
    t0 = time.perf_counter()
    outs = []
    for _ in range(20):
        outs += step()
    mx.eval(outs)
    mx.synchronize()
    batched = (time.perf_counter() - t0) / 20
    return statistics.median(walls) * 1e6, statistics.median(builds) * 1e6, batched * 1e6


def main():
    what = sys.argv[1]
    lengths = [int(x) for x in sys.argv[2:]] or [4096, 16384, 32768]
    variants = [
        tuple(int(x) for x in v.split(":"))
        for v in os.environ.get("VARIANTS", "1:0,1:1").split(",")
    ]
    for length in lengths:
        for label, step in steppers(length):
            for variant in variants if label != "16-bit" else [(0, 0)]:
                kvkernels.stage_keys, kvkernels.compile_launches = (
                    bool(variant[0]),
                    bool(variant[1]),
                )
                if what == "ncu":
                    mx.eval(step())
                    continue
                wall, build, batched = timed(step)
                print(
                    f"{length:6d} {label:7s} staged {variant[0]} compiled {variant[1]}"
                    f"  step {wall:8.1f} us"
                    f"  host build {build:7.1f} us  20-in-one-eval {batched:8.1f} us/step",
                    flush=True,
                )
        mx.clear_cache()


if __name__ == "__main__":
    main()
