"""A short turn's attention over float16 rows (app/engine/short_turn.c through
kvnative and turn_attention): its products and softmax against numpy, and the turn
against the dense oracle, on one thread and two, with and without the library."""

from __future__ import annotations

import os
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from children import assert_child_succeeds
from test_kv_native import packed_rows

from app.engine import cpu_blas, kvattention, kvcpu, kvnative, turn_attention
from app.engine.kvquant import MixedKVCache
from app.engine.kvscheme import APP_SCHEMES, SIXTEEN_BIT, KVScheme

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the CPU path's products")


TURN_CASES = [  # (dim, queries, tokens): partial tiles of tokens and queries
    (64, 51, 4099),
    (64, 2, 9),
    (128, 34, 300),
    (256, 64, 33),
]


@pytest.mark.skipif(not kvnative.available(), reason="the library was not built here")
@pytest.mark.parametrize(("dim", "queries", "tokens"), TURN_CASES, ids=str)
def test_a_short_turns_products_equal_numpy(dim, queries, tokens):
    """short_turn.c's scores (token-major, from the queries transposed and padded to
    the tile) and values (added to what `out` holds) over a strided span of float16
    rows, against numpy's products of the rows widened."""
    rows, wide = packed_rows(None, 1, tokens, dim, dim)
    _check_turn_products(rows.codes[0], wide[0], queries)  # one KV head: (tokens, dim)


PACKED_TURN_CASES = [  # (bits, dim, group, queries, tokens)
    (8, 64, 64, 51, 4099),  # the app's 8-bit on the starter
    (4, 64, 64, 51, 301),
    (8, 128, 32, 34, 300),
    (4, 128, 32, 2, 9),
    (4, 256, 128, 64, 33),
]


@pytest.mark.skipif(not kvnative.available(), reason="the library was not built here")
@pytest.mark.parametrize(("bits", "dim", "group", "queries", "tokens"), PACKED_TURN_CASES, ids=str)
def test_a_short_turns_products_over_packed_rows_equal_numpy(bits, dim, group, queries, tokens):
    """The same products over rows packed 4 or 8 bits (a strided span of a store's
    codes, scales and biases), against numpy's products of the rows dequantized."""
    rows, wide = packed_rows(bits, 1, tokens, dim, group)
    packed = kvnative.PackedTurnRows(bits, rows.codes[0], rows.scales[0], rows.biases[0])
    _check_turn_products(packed, wide[0], queries)


def _check_turn_products(rows, wide: np.ndarray, queries: int) -> None:
    """The turn products over `rows` against numpy's over `wide`, what they stand for
    (tokens, dim) in float32."""
    tokens, dim = wide.shape
    width = -(-queries // kvnative.TURN_QUERIES) * kvnative.TURN_QUERIES
    used = -(-queries // kvnative.TURN_VALUE_QUERIES) * kvnative.TURN_VALUE_QUERIES
    rng = np.random.default_rng(tokens)
    qt = np.zeros((dim, width), np.float32)
    qt[:, :queries] = rng.standard_normal((dim, queries), np.float32)
    st = np.full((tokens, width), np.nan, np.float32)
    kvnative.turn_scores(rows, qt, st)
    np.testing.assert_allclose(st, wide @ qt, rtol=1e-4, atol=1e-3)
    pt = rng.random((tokens, width), np.float32)
    out = np.ones((used, dim), np.float32)
    kvnative.turn_values(rows, pt, out)
    np.testing.assert_allclose(out, 1 + pt[:, :used].T @ wide, rtol=1e-4, atol=1e-2)


@pytest.mark.skipif(not kvnative.available(), reason="the library was not built here")
def test_packed_rows_the_products_do_not_read_are_refused():
    """Codes, scales and biases that do not describe rows the C unpacks (a width it
    does not take, scales of another type, groups that do not divide the row) are
    refused before any call."""
    rows, _ = packed_rows(8, 1, 40, 64, 32)
    codes, scales, biases = rows.codes[0], rows.scales[0], rows.biases[0]
    assert kvnative.PackedTurnRows.takes(8, codes, scales, biases)
    assert not kvnative.PackedTurnRows.takes(3, codes, scales, biases)
    assert not kvnative.PackedTurnRows.takes(8, codes, scales.astype(np.float32), biases)
    thirds = np.zeros((len(scales), 3), np.float16)
    assert not kvnative.PackedTurnRows.takes(8, codes, thirds, thirds)
    assert not kvnative.PackedTurnRows.takes(8, codes[:, :5], scales, biases)
    with pytest.raises(ValueError):
        kvnative.PackedTurnRows(8, codes, scales[:, :0], biases[:, :0])
    # tokens a part of a word apart (hand-built: the C would step past the span)
    raw = np.zeros(8 * 66 + 64, np.uint8)
    start = np.frombuffer(raw.data, np.uint32, 16, 7 * 66)
    skewed = np.lib.stride_tricks.as_strided(start, (8, 16), (-66, 4))
    ones = np.ones((8, 1), np.float16)
    assert not kvnative.PackedTurnRows.takes(8, skewed, ones, ones)
    halves = np.frombuffer(raw.data, np.float16, 64, 1)
    skewed_rows = np.lib.stride_tricks.as_strided(halves, (4, 64), (129, 2))
    with pytest.raises(ValueError):
        kvnative.turn_scores(
            skewed_rows, np.zeros((64, 32), np.float32), np.empty((4, 32), np.float32)
        )


@pytest.mark.skipif(not kvnative.available(), reason="the library was not built here")
@pytest.mark.parametrize(("tokens", "queries"), [(4099, 64), (3, 32), (700, 1024)], ids=str)
def test_a_short_turns_softmax_equals_numpy(tokens, queries):
    """Each query's (column's) e^(score - maximum) and sum, the causal mask's -inf
    entries 0, scores from -80 to 80 (a softmax's whole useful range)."""
    rng = np.random.default_rng(tokens)
    st = rng.uniform(-80, 80, (tokens, queries)).astype(np.float32)
    st[-3:, ::3] = -np.inf
    with np.errstate(invalid="ignore"):  # -inf - -inf in the 3-token case
        want = np.exp(st - st.max(axis=0))
    want[~np.isfinite(want)] = 0  # a query that sees nothing: no weight anywhere
    totals = kvnative.turn_softmax(st)
    np.testing.assert_allclose(st, want, rtol=2e-6, atol=1e-37)
    np.testing.assert_allclose(totals, want.sum(axis=0), rtol=1e-5)
    assert (st[-3:, ::3] == 0).all()


@pytest.mark.skipif(not kvnative.available(), reason="the library was not built here")
def test_a_short_turns_products_refuse_what_they_do_not_take():
    rows = np.zeros((40, 64), np.float16)
    qt, st = np.zeros((64, 32), np.float32), np.zeros((40, 32), np.float32)
    kvnative.turn_scores(rows, qt, st)
    for bad in (
        lambda: kvnative.turn_scores(rows, np.zeros((64, 48), np.float32), st),  # not a tile
        lambda: kvnative.turn_scores(rows, qt, np.zeros((39, 32), np.float32)),  # rows past st
        lambda: kvnative.turn_scores(np.zeros((40, 80), np.float16), qt, st),  # width
        lambda: kvnative.turn_values(rows, st, np.zeros((36, 64), np.float32)),  # queries past pt
        lambda: kvnative.turn_values(rows, st, np.zeros((6, 64), np.float32)),  # not a tile
        lambda: kvnative.turn_values(rows[::2], st[:20], np.zeros((4, 32), np.float32)),
        lambda: kvnative.turn_softmax(np.zeros((4, 48), np.float32)),  # not a tile
        lambda: kvnative.turn_softmax(np.zeros((4, 1056), np.float32)),  # past its sums
    ):
        with pytest.raises(ValueError, match="do not fit"):
            bad()


# A float16 scheme with 16-bit sink and tail rows beside the bulk: the app's float16
# cache has none, but the short turn's products read all three, in temporal order.
WITH_EXACT_ROWS = KVScheme(None, None, 64, sink=4, window=64)


@pytest.fixture(autouse=True)
def _short_turns_compiled(monkeypatch):
    """The short turn's products are taken only where their AVX-512 build runs; these
    tests hold whatever build is here to the oracle (where the library was built)."""
    monkeypatch.setattr(kvnative, "turn_faster_here", kvnative.available)


@pytest.mark.parametrize(
    ("rows", "heads", "kv_heads", "dim", "scheme", "mask"),
    [
        (2, 6, 2, 64, SIXTEEN_BIT, "causal"),
        (17, 9, 3, 64, SIXTEEN_BIT, "causal"),  # the starter's heads: 51 queries a KV head
        (64, 6, 2, 64, SIXTEEN_BIT, "causal"),
        (65, 6, 2, 64, SIXTEEN_BIT, "causal"),  # past the short turn: mlx's products
        (17, 8, 8, 128, SIXTEEN_BIT, "causal"),
        (5, 4, 2, 80, SIXTEEN_BIT, "causal"),  # a width the products do not take
        (17, 9, 3, 64, WITH_EXACT_ROWS, "causal"),
        (7, 6, 2, 64, SIXTEEN_BIT, None),
        (17, 9, 3, 64, APP_SCHEMES["8-bit"], "causal"),  # the bulk packed, sink and tail exact
        (17, 9, 3, 64, APP_SCHEMES["4-bit"], "causal"),  # keys rotated too
        (5, 4, 2, 128, replace(APP_SCHEMES["8-bit"], group_size=32), None),
        (9, 8, 8, 128, replace(APP_SCHEMES["4-bit"], group_size=128), "causal"),
    ],
)
def test_a_short_turn_over_float16_rows_matches_the_oracle(
    rows, heads, kv_heads, dim, scheme, mask
):
    """The CPU path's 16 bits (both halves float16), and the app's 8-bit and 4-bit (the
    bulk packed): a short turn's rows attend under the causal mask (or none) to what
    the oracle attends to, every row widened (dequantized, un-rotated)."""
    layer = MixedKVCache(scheme)
    shape = (1, kv_heads, 300, dim)
    keys, values = (mx.random.normal(shape, key=mx.random.key(k)) for k in (1, 2))
    layer.update_and_fetch(keys[..., :-rows, :], values[..., :-rows, :])
    layer.update_and_fetch(keys[..., -rows:, :], values[..., -rows:, :])
    queries = mx.random.normal((1, heads, rows, dim), key=mx.random.key(3))
    got = layer.attend(queries, 0.125, mask)
    keys, values = (layer.reference_read(part, mx.float32) for part in (0, 1))
    want = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.125, mask=mask)
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()


def test_a_packed_bulk_laid_out_otherwise_goes_to_the_dense_path():
    """Scales that are a transposed view (each token's groups not one run of memory) are
    not what the compiled products read: that turn takes the dense path, and attends as
    the oracle does."""
    layer = MixedKVCache(APP_SCHEMES["8-bit"])
    shape = (1, 2, 300, 128)
    keys, values = (mx.random.normal(shape, key=mx.random.key(k)) for k in (1, 2))
    layer.update_and_fetch(keys[..., :-9, :], values[..., :-9, :])
    layer.update_and_fetch(keys[..., -9:, :], values[..., -9:, :])
    queries = mx.random.normal((1, 6, 9, 128), key=mx.random.key(3))
    assert turn_attention.applies(layer.layout(), queries, "causal", None)
    store = layer.bulk[0]
    scales = np.asarray(store.buffers[1])
    store.buffers[1] = mx.swapaxes(mx.array(np.ascontiguousarray(scales.swapaxes(2, 3))), 2, 3)
    assert not turn_attention.applies(layer.layout(), queries, "causal", None)
    got = layer.attend(queries, 0.125, "causal")
    keys, values = (layer.reference_read(part, mx.float32) for part in (0, 1))
    want = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.125, mask="causal")
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()


@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (8, 8), (4, 1)])
def test_a_short_turn_on_two_threads_matches_the_oracle(monkeypatch, heads, kv_heads):
    """A turn on two threads shares its KV heads with the helper thread (an odd count,
    an even one, one alone): the same attention as the oracle's."""
    monkeypatch.setattr(cpu_blas, "threads", lambda: 2)
    test_a_short_turn_over_float16_rows_matches_the_oracle(
        17, heads, kv_heads, 64, SIXTEEN_BIT, "causal"
    )


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX's")
def test_a_forked_child_shares_its_heads_without_the_parent_s_helper(monkeypatch):
    """The helper thread is not in a child of fork: a shared turn there must not wait
    on it (the heads' work here is plain Python: mlx itself is not fork-safe)."""
    monkeypatch.setattr(cpu_blas, "threads", lambda: 2)
    done_heads = []
    turn_attention._shared(lambda a, b: done_heads.extend(range(a, b)), 3)
    assert sorted(done_heads) == [0, 1, 2]  # the helper took its share
    child = os.fork()
    if child == 0:
        heads = []
        turn_attention._shared(lambda a, b: heads.extend(range(a, b)), 3)
        os._exit(0 if sorted(heads) == [0, 1, 2] else 1)
    assert_child_succeeds(child, "turn")


def test_a_cpu_without_the_wide_build_keeps_mlx_s_route_for_a_short_turn(monkeypatch):
    """Without AVX-512 a sixteen-lane tile spills (GCC 11's AVX2 build was 7x slower
    than mlx's route): such a CPU keeps mlx's products."""
    monkeypatch.setattr(kvnative, "turn_faster_here", lambda: False)
    layer = MixedKVCache(SIXTEEN_BIT)
    keys = mx.random.normal((1, 3, 300, 64), key=mx.random.key(1))
    layer.update_and_fetch(keys, keys)
    queries = mx.random.normal((1, 9, 17, 64), key=mx.random.key(3))
    assert not turn_attention.applies(layer.layout(), queries, "causal", None)


def test_the_switch_that_turns_the_library_off_turns_off_the_short_turn_too(monkeypatch):
    """`REPRISE_KV_NATIVE=off` keeps numpy and mlx for every product, a short turn's too."""
    monkeypatch.setattr(kvnative, "enabled", False)
    assert not kvnative.turn_fits(64)
    layer = MixedKVCache(SIXTEEN_BIT)
    keys = mx.random.normal((1, 3, 300, 64), key=mx.random.key(1))
    layer.update_and_fetch(keys, keys)
    queries = mx.random.normal((1, 9, 17, 64), key=mx.random.key(3))
    assert not turn_attention.applies(layer.layout(), queries, "causal", None)


@pytest.mark.skipif(not kvnative.available(), reason="the library was not built here")
def test_a_short_turn_reads_the_float16_rows_where_they_are(monkeypatch):
    """A 17-token turn over the CPU path's float16 cache goes to the compiled products:
    no float32 copy of the cached rows is made for it."""

    def widened(*_args, **_kwargs):
        raise AssertionError("the cached rows were widened for a short turn")

    monkeypatch.setattr(kvcpu, "widened", widened)
    monkeypatch.setattr(kvattention, "widen", widened)
    layer = MixedKVCache(SIXTEEN_BIT)
    keys = mx.random.normal((1, 3, 1000, 64), key=mx.random.key(1))
    layer.update_and_fetch(keys, keys)
    queries = mx.random.normal((1, 9, 17, 64), key=mx.random.key(3))
    layer.update_and_fetch(keys[..., :17, :], keys[..., :17, :])
    assert layer.attend(queries, 0.125, "causal").shape == (1, 9, 17, 64)


def test_a_short_turn_reads_a_buffer_laid_out_as_its_first_update():
    """A store whose first update filled its buffer whole holds that update's layout
    (mlx keeps it: a model's values arrive transposed), so its tokens are not one run
    of memory; after a trim (a regenerated reply) the next turn fits without regrowing
    and still attends to what the oracle does."""
    layer = MixedKVCache(SIXTEEN_BIT)
    keys, values = (
        mx.random.normal((1, 256, 2, 64), key=mx.random.key(k)).transpose(0, 2, 1, 3)
        for k in (1, 2)
    )
    layer.update_and_fetch(keys, values)
    layer.trim(5)
    layer.update_and_fetch(keys[..., -5:, :], values[..., -5:, :])
    queries = mx.random.normal((1, 6, 5, 64), key=mx.random.key(3))
    got = layer.attend(queries, 0.125, "causal")
    keys, values = (layer.reference_read(part, mx.float32) for part in (0, 1))
    want = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.125, mask="causal")
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()
