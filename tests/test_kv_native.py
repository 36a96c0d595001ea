"""The compiled products of the CPU path's packed-cache attention (app/engine/kvdecode.c
through kvnative) against plain numpy arithmetic on the same codes, and the decode
step that uses them against the dequantized oracle, with the library and without; the
library built other ways. A short turn's products are tests/test_short_turn.py's."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from app.engine import cpu_blas, kvattention, kvnative
from app.engine.kvquant import MixedKVCache
from app.engine.kvscheme import APP_SCHEMES, SIXTEEN_BIT, KVScheme

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the CPU path's products")


def packed_rows(bits: int | None, heads: int, tokens: int, dim: int, group: int, room: int = 19):
    """Rows of `heads` KV heads as a TokenStore holds them: a buffer with room past
    its tokens (so each head's rows are a strided slice), quantized or float16; and
    the values they stand for, as float32 numpy (heads, tokens, dim)."""
    x = mx.random.normal((1, heads, tokens + room, dim), key=mx.random.key(tokens + dim))
    x = (x * mx.where(mx.arange(dim) == 5, 9.0, 1.0)).astype(mx.float16)
    if bits is None:
        buffers, wide = [x], x.astype(mx.float32)
    else:
        buffers = list(mx.quantize(x, group_size=group, bits=bits))
        codes, scales, biases = buffers  # dequantized in float32, as the C computes
        scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
        wide = mx.dequantize(codes, scales, biases, group_size=group, bits=bits)
    mx.eval(buffers, wide)
    views = [np.asarray(b)[0, :, 3 : 3 + tokens] for b in buffers]  # a sliced token span
    return kvnative.Rows(bits, views), np.asarray(wide)[0, :, 3 : 3 + tokens]


CASES = [  # (bits, dim, group, queries, tokens): partial blocks of 8, 1 to 9 queries
    (8, 64, 64, 3, 2053),
    (8, 128, 32, 1, 17),
    (4, 64, 32, 3, 301),
    (4, 128, 128, 8, 1),
    (4, 96, 32, 9, 64),
    (None, 64, 64, 3, 131),
    (None, 256, 256, 2, 7),
]


@pytest.mark.skipif(not kvnative.available(), reason="the library was not built here")
@pytest.mark.parametrize(("bits", "dim", "group", "queries", "tokens"), CASES, ids=str)
def test_a_layer_s_attention_equals_numpy_on_the_dequantized_rows(
    bits, dim, group, queries, tokens
):
    """`attend` on 16-bit rows (the exact part) then the case's rows (the bulk), one
    softmax over both, on one thread and shared among two."""
    heads = 3
    bulk, wide = packed_rows(bits, heads, tokens, dim, group)
    exact, exact_wide = packed_rows(None, heads, 5, dim, dim)
    rng = np.random.default_rng(tokens)
    q = rng.standard_normal((heads, queries, dim), np.float32)
    rows = np.concatenate([exact_wide, wide], axis=1)
    scores = np.einsum("hqd,htd->hqt", q, rows)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    want = np.einsum("hqt,htd->hqd", weights / weights.sum(axis=-1, keepdims=True), rows)
    for threads in (1, 2):
        out = np.full((heads, queries, dim), np.nan, np.float32)
        kvnative.attend([exact, exact, bulk, bulk], q, q, out, threads)
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not kvnative.available(), reason="the library was not built here")
def test_shapes_the_library_does_not_take_are_refused_before_any_call():
    rows, _ = packed_rows(8, 2, 40, 64, 64)
    assert rows.fits(3)
    assert not rows.fits(65)  # more queries a KV head than it holds sums for
    wide, _ = packed_rows(None, 1, 4, 2048, 2048)
    assert not wide.fits(1)  # a row wider than its scratch
    short = kvnative.Rows(8, [rows.codes, rows.scales[:, :-1], rows.biases[:, :-1]])
    assert not short.fits(3)  # scales for fewer tokens than codes: never read past them
    q, out = np.zeros((2, 3, 64), np.float32), np.zeros((2, 3, 64), np.float32)
    with pytest.raises(ValueError, match="do not fit"):  # a query of another width
        kvnative.attend([rows] * 4, q[..., :32], q[..., :32], out)
    with pytest.raises(ValueError, match="do not fit"):  # an output of another shape
        kvnative.attend([rows] * 4, q, q, out[:, :2])


@pytest.mark.skipif(not kvnative.available(), reason="the library was not built here")
@pytest.mark.parametrize("bits", [2, 3, 5, 6])
def test_rows_of_a_width_the_library_does_not_read_are_refused(bits):
    """The C reads 4- and 8-bit codes and float16 rows; it would read rows of any other
    width as float16, several times past each row's bytes."""
    codes = np.zeros((1, 16, 2 * bits), np.uint32)  # 64 values a row, one group
    scales = np.ones((1, 16, 1), np.float16)
    assert not kvnative.Rows(bits, [codes, scales, scales.copy()]).fits(1)


@pytest.mark.skipif(not kvnative.available(), reason="the library was not built here")
def test_the_products_hold_to_the_library_limits_whoever_calls_them():
    """`attend` refuses what `fits` refuses, not only kvcpu's calls after it: more
    queries than the C holds sums for (one group here, so that the C would still stay
    inside its arrays if called)."""
    rows, _ = packed_rows(8, 1, 9, 64, 64)
    q = np.zeros((1, 65, 64), np.float32)
    with pytest.raises(ValueError, match="do not fit"):
        kvnative.attend([rows] * 4, q, q, np.zeros((1, 65, 64), np.float32))


# The library (kvdecode.c, short_turn.c, packed_rows.c) built as others may build
# it: a packager's CFLAGS that stop inlining (the AVX2 clone then calls helpers
# compiled for plain x86-64), a compiler without __builtin_shufflevector (the
# portable lane sums), GCC 11 (Ubuntu 22.04's: no dispatcher for x86-64-v3 or v4
# clones), Clang (macOS's: no clones). One not here is skipped.
BUILDS = {
    "no inlining": ("cc", "-O3", "-fno-inline"),
    "portable sums": ("cc", "-O3", "-U__has_builtin"),
    "gcc 11": ("gcc-11", "-O3"),
    "clang": (shutil.which("clang") or "clang-14", "-O3"),
}
ENGINE = Path(__file__).parents[1] / "app" / "engine"
SOURCES = [str(ENGINE / name) for name in ("kvdecode.c", "short_turn.c", "packed_rows.c")]
# Python's headers too: without them (no python3-dev) setup.py skips the extension.
HEADERS = Path(sysconfig.get_paths()["include"], "Python.h").exists()
CHECK = """import sys
sys.path[:0] = [sys.argv[2], sys.argv[2] + "/tests"]
import app.engine
from app.engine import kvnative, packed_rows
kvnative._library, kvnative._tried = kvnative._open(sys.argv[1]), True
packed_rows._library, packed_rows._tried = packed_rows._open(sys.argv[1]), True
import test_kv_native as t
import test_packed_rows as p
import test_short_turn as s
for bits, group in ((4, 32), (8, 32)):
    p.test_a_product_is_the_dequantized_weight_s(bits, group, 130, 2)
    p.test_a_few_rows_product_is_the_dequantized_weight_s(bits, group, 130, 17, 2)
for case in t.CASES:
    t.test_a_layer_s_attention_equals_numpy_on_the_dequantized_rows(*case)
for case in s.TURN_CASES:
    s.test_a_short_turns_products_equal_numpy(*case)
for case in s.PACKED_TURN_CASES:
    s.test_a_short_turns_products_over_packed_rows_equal_numpy(*case)
s.test_a_short_turns_softmax_equals_numpy(4099, 64)
"""


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the CPU path's products")
@pytest.mark.parametrize("build", BUILDS.values(), ids=BUILDS.keys())
def test_the_library_built_other_ways_gives_the_same_products(tmp_path, build):
    """Built here, then checked in a child process: a crash fails the test."""
    compiler, *flags = build
    if shutil.which(compiler) is None or not HEADERS:
        pytest.skip(f"no {compiler} or no Python headers here")
    include = sysconfig.get_paths()["include"]
    built = tmp_path / "kvdecode.so"
    command = [compiler, *flags, "-Wno-psabi", "-shared", "-fPIC", f"-I{include}"]
    done = subprocess.run([*command, *SOURCES, "-o", str(built)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    root = str(ENGINE.parents[1])
    check = [sys.executable, "-c", CHECK, str(built), root]
    done = subprocess.run(check, capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])


@pytest.mark.skipif(shutil.which("cc") is None or not HEADERS, reason="nothing to build it with")
def test_a_checkout_with_a_compiler_builds_and_uses_the_library(monkeypatch):
    """`make setup` compiles kvdecode.c; a decode step over a packed cache calls it."""
    assert kvnative.available()
    calls = []
    original = kvnative.attend
    monkeypatch.setattr(kvnative, "attend", lambda *a: calls.append(a) or original(*a))
    layer = _filled(APP_SCHEMES["8-bit"])
    queries = mx.random.normal((1, 4, 1, 64), key=mx.random.key(3))
    layer.attend(queries, 0.125, None)
    stores = calls[0][0]
    assert len(calls) == 1  # the layer's every KV head in one call
    assert [rows.tokens > 0 for rows in stores] == [True] * 4  # exact rows and bulk


@pytest.mark.parametrize("native", [True, False], ids=["library", "numpy"])
def test_a_decode_step_matches_the_oracle_with_and_without_the_library(monkeypatch, native):
    if native and not kvnative.available():
        pytest.skip("the library was not built here")
    monkeypatch.setattr(kvnative, "enabled", native)
    mixed = [KVScheme(8, None, 64, sink=4, window=16), KVScheme(None, 4, 32, 4, 16, True)]
    for scheme in [*APP_SCHEMES.values(), *mixed, KVScheme(8, 4, 32)]:
        layer = _filled(scheme)
        queries = mx.random.normal((1, 4, 1, 64), key=mx.random.key(9))
        got = layer.attend(queries, 0.125, None)
        keys, values = (layer.reference_read(part, mx.float32) for part in (0, 1))
        want = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.125)
        assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item(), scheme.format


EDGES = {  # (scheme, batch, query heads a KV head, tokens, sliding window): library or not
    "batch of 2": (APP_SCHEMES["4-bit"], 2, 3, 333, {}, True),
    "no 16-bit row": (KVScheme(8, 8, 64), 1, 2, 320, {}, True),
    "front dropped": (APP_SCHEMES["8-bit"], 1, 2, 300, {"max_size": 160, "keep": 4}, True),
    "65 query heads": (APP_SCHEMES["8-bit"], 1, 65, 200, {}, False),
}


@pytest.mark.skipif(not kvnative.available(), reason="the library was not built here")
@pytest.mark.parametrize("edge", EDGES.values(), ids=EDGES.keys())
def test_a_decode_step_at_the_edges_of_a_layout_matches_the_oracle(monkeypatch, edge):
    """Layouts the C must read right or leave to numpy: every head of a batch, a layer
    whose tokens are all quantized (no exact row), a sliding window whose buffers
    start past their front, more query heads a KV head than the C holds sums for."""
    scheme, batch, ratio, tokens, window, native = edge
    calls = []
    original = kvnative.attend
    monkeypatch.setattr(kvnative, "attend", lambda *a: calls.append(a[0]) or original(*a))
    layer = MixedKVCache(scheme, **window)
    keys, values = (mx.random.normal((batch, 2, tokens, 64), key=mx.random.key(k)) for k in (1, 2))
    layer.update_and_fetch(keys[..., :-1, :], values[..., :-1, :])
    layer.update_and_fetch(keys[..., -1:, :], values[..., -1:, :])
    assert not window or layer.bulk[0].lo > 0  # the window's buffers start past their front
    queries = mx.random.normal((batch, 2 * ratio, 1, 64), key=mx.random.key(3))
    got = layer.attend(queries, 0.125, None)
    keys, values = (layer.reference_read(part, mx.float32) for part in (0, 1))
    want = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.125)
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()
    assert len(calls) == (1 if native else 0)  # every KV head of the batch at once
    stores = 2 if scheme.window else 1  # exact rows and bulk, keys and values of each
    assert all(sum(rows.tokens > 0 for rows in call) == 2 * stores for call in calls)


@pytest.mark.skipif(not kvnative.available(), reason="the library was not built here")
@pytest.mark.parametrize("threads", [1, 2, 3, 5])
@pytest.mark.parametrize("scheme", [APP_SCHEMES["8-bit"], APP_SCHEMES["4-bit"], SIXTEEN_BIT])
def test_a_decode_step_shared_among_threads_matches_the_oracle(monkeypatch, scheme, threads):
    """The tokens of a layer's attention are shared among the products' threads, each
    share's softmax on its own maximum, joined after: any number of shares, runs of
    exact and quantized rows split unevenly among them, gives the oracle's output."""
    monkeypatch.setattr(cpu_blas, "threads", lambda: threads)
    shared = []
    original = kvnative.attend
    monkeypatch.setattr(kvnative, "attend", lambda *a: shared.append(a[-1]) or original(*a))
    layer = MixedKVCache(scheme)
    keys, values = (mx.random.normal((1, 2, 701, 64), key=mx.random.key(k)) for k in (4, 5))
    layer.update_and_fetch(keys[..., :-1, :], values[..., :-1, :])
    layer.update_and_fetch(keys[..., -1:, :], values[..., -1:, :])
    queries = mx.random.normal((1, 6, 1, 64), key=mx.random.key(6)) * 3
    got = layer.attend(queries, 0.125, None)
    keys, values = (layer.reference_read(part, mx.float32) for part in (0, 1))
    want = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.125)
    assert shared == [threads]
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()


@pytest.mark.skipif(not kvnative.available(), reason="the library was not built here")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["NaN", "inf"])
def test_a_diverged_query_gives_nan_as_the_numpy_path_does(monkeypatch, threads, bad):
    """A model that has diverged (a NaN or infinite query) shows it in its output on
    either path: the compiled one does not hide it as zeros or finite values."""
    monkeypatch.setattr(cpu_blas, "threads", lambda: threads)
    layer = _filled(APP_SCHEMES["8-bit"])
    queries = mx.random.normal((1, 4, 1, 64), key=mx.random.key(7))
    queries = mx.where(mx.arange(4)[None, :, None, None] == 1, bad, queries)  # one head
    got = np.array(layer.attend(queries, 0.125, None))
    monkeypatch.setattr(kvnative, "enabled", False)
    with np.errstate(invalid="ignore"):  # numpy's own warning of the NaN it computes
        want = np.array(layer.attend(queries, 0.125, None))
    assert np.isnan(got[0, 1]).all() and np.isnan(want[0, 1]).all()
    assert np.isfinite(got[0, [0, 2, 3]]).all()
    np.testing.assert_allclose(got[0, [0, 2, 3]], want[0, [0, 2, 3]], rtol=1e-4, atol=1e-4)


def _filled(scheme: KVScheme) -> MixedKVCache:
    """A layer of 2 KV heads after a prefill of 320 tokens and 13 decode steps."""
    layer = MixedKVCache(scheme)
    keys = mx.random.normal((1, 2, 333, 64), key=mx.random.key(1))
    values = mx.random.normal((1, 2, 333, 64), key=mx.random.key(2))
    layer.update_and_fetch(keys[..., :320, :], values[..., :320, :])
    for t in range(320, 333):
        layer.update_and_fetch(keys[..., t : t + 1, :], values[..., t : t + 1, :])
    mx.eval(layer.state)
    assert kvattention._on_the_cpu_path(layer.layout(), mx.zeros((1, 4, 1, 64)))
    return layer


@pytest.mark.skipif(shutil.which("cc") is None or not HEADERS, reason="nothing to build it with")
def test_a_library_built_for_other_arguments_is_not_called(tmp_path):
    """A stale build beside newer Python (its arguments changed since) is refused,
    and the numpy path runs, rather than the C called with the wrong arguments."""
    include = sysconfig.get_paths()["include"]
    stale = tmp_path / "stale.so"
    command = ["cc", "-O1", "-Wno-psabi", "-shared", "-fPIC", f"-I{include}"]
    command += [f"-DREPRISE_KV_ABI={kvnative.ABI + 1}", *SOURCES, "-o", str(stale)]
    assert subprocess.run(command, capture_output=True).returncode == 0
    assert kvnative._open(str(stale)) is None
    current = tmp_path / "current.so"
    command[-len(SOURCES) - 3 :] = [
        f"-DREPRISE_KV_ABI={kvnative.ABI}",
        *SOURCES,
        "-o",
        str(current),
    ]
    assert subprocess.run(command, capture_output=True).returncode == 0
    assert kvnative._open(str(current)).limits[1] == 64


@pytest.mark.skipif(not kvnative.available(), reason="the library was not built here")
def test_float16_rows_are_widened_exactly():
    """A float16 cache's token span (a strided view of its buffer), subnormals and the
    largest values included, as float32: what numpy's cast gives, bit for bit."""
    x = mx.random.normal((2, 3, 300, 64), key=mx.random.key(7)) * 3000
    x[..., 0, :4] = mx.array([6e-8, -6e-8, 65504, -65504])  # subnormal and largest
    rows = np.asarray(x.astype(mx.float16))[:, :, 10:290]
    assert np.array_equal(kvnative.widen_halves(rows), rows.astype(np.float32))
