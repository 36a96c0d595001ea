"""Attention on the CPU path computed with numpy (app/engine/cpu_attention.py) against
mlx's own fused attention, its reference: every mask mlx-lm builds, grouped-query
ratios, decode and prefill rows, and blocks of query rows; then inside a model."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from app.engine import cpu_attention, cpu_blas

pytestmark = pytest.mark.skipif(
    mx.default_device() != mx.cpu, reason="the numpy path serves the CPU only"
)

# (head size, query heads, KV heads): grouped-query ratios 1, 3 and 4.
SHAPES = [(64, 4, 4), (64, 9, 3), (32, 8, 2)]


def arrays(heads: int, kv_heads: int, dim: int, rows: int, length: int):
    q = mx.random.normal((1, heads, rows, dim), key=mx.random.key(1))
    k = mx.random.normal((1, kv_heads, length, dim), key=mx.random.key(2)) * 2
    v = mx.random.normal((1, kv_heads, length, dim), key=mx.random.key(3))
    return q, k, v


def matches(q, k, v, mask) -> bool:
    scale = q.shape[-1] ** -0.5
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    got = cpu_attention.attention(q, k, v, scale, mask)
    assert got.shape == want.shape and got.dtype == want.dtype
    return mx.allclose(got, want, atol=1e-5, rtol=1e-4).item()


@pytest.mark.parametrize("dim, heads, kv_heads", SHAPES)
@pytest.mark.parametrize("rows, length", [(1, 1), (1, 700), (37, 37), (64, 700)])
def test_causal_and_unmasked_rows_match_mlx(dim, heads, kv_heads, rows, length):
    q, k, v = arrays(heads, kv_heads, dim, rows, length)
    assert matches(q, k, v, "causal")
    assert matches(q, k, v, None)


@pytest.mark.parametrize("dim, heads, kv_heads", SHAPES)
def test_array_masks_match_mlx(dim, heads, kv_heads):
    """A sliding window's boolean mask, an additive mask, and one mask per head."""
    rows, length, window = 48, 300, 20
    q, k, v = arrays(heads, kv_heads, dim, rows, length)
    position = mx.arange(length - rows, length)[:, None]
    key = mx.arange(length)[None, :]
    sliding = (key <= position) & (key > position - window)
    assert matches(q, k, v, sliding)
    assert matches(q, k, v, mx.where(sliding, 0.0, -1e9) + mx.random.normal(sliding.shape))
    per_head = mx.random.uniform(shape=(1, heads, rows, length), key=mx.random.key(4)) > 0.3
    assert matches(q, k, v, per_head | (key == 0))  # every row sees at least one key


@pytest.mark.parametrize("dim, heads, kv_heads", SHAPES)
def test_a_decode_row_under_a_window_or_additive_mask_matches_mlx(dim, heads, kv_heads):
    """One query row goes through the OpenBLAS products of `cpu_blas`; with no OpenBLAS,
    through numpy's matmul."""
    q, k, v = arrays(heads, kv_heads, dim, 1, 300)
    sliding = mx.arange(300)[None, :] > 299 - 20
    per_head = mx.random.uniform(shape=(1, heads, 1, 300), key=mx.random.key(4)) > 0.3
    for mask in (None, sliding, mx.where(sliding, 0.0, -1e9), per_head | sliding):
        assert matches(q, k, v, mask)


def test_a_decode_row_without_openblas_takes_numpys_products(monkeypatch):
    q, k, v = arrays(9, 3, 64, 1, 300)
    monkeypatch.setattr(cpu_blas, "available", lambda: False)
    assert matches(q, k, v, None)


def test_blocks_of_query_rows_give_the_same_attention(monkeypatch):
    """Long contexts are done a few query rows at a time: block edges change nothing,
    causal or masked."""
    q, k, v = arrays(9, 3, 64, 100, 400)
    monkeypatch.setattr(cpu_attention, "_BLOCK_BYTES", 4 * 9 * 400 * 7)  # 7 rows a block
    window = (mx.arange(400)[None, :] > mx.arange(300, 400)[:, None] - 50) & (
        mx.arange(400)[None, :] <= mx.arange(300, 400)[:, None]
    )
    assert matches(q, k, v, "causal")
    assert matches(q, k, v, window)


def test_a_slice_of_a_larger_cache_buffer_is_read_in_place():
    """What KVCache hands out: the first `offset` rows of a buffer with room."""
    q, _, _ = arrays(9, 3, 64, 1, 1)
    buffer_k = mx.random.normal((1, 3, 512, 64), key=mx.random.key(5))
    buffer_v = mx.random.normal((1, 3, 512, 64), key=mx.random.key(6))
    assert matches(q, buffer_k[:, :, :300], buffer_v[:, :, :300], None)


def test_only_float32_on_the_cpu_without_sinks_takes_the_numpy_path():
    q, k, _ = arrays(4, 4, 64, 1, 8)
    assert cpu_attention.applies(q, k, None)
    assert not cpu_attention.applies(q.astype(mx.float16), k.astype(mx.float16), None)
    assert not cpu_attention.applies(q, k, mx.zeros((4,)))


def test_a_model_on_the_cpu_path_attends_through_numpy_with_mlxs_logits(tiny_model, monkeypatch):
    model = tiny_model.model
    tokens = mx.random.randint(3, 200, (120,), key=mx.random.key(8))
    calls = []
    attention = cpu_attention.attention
    monkeypatch.setattr(
        cpu_attention, "attention", lambda *a: calls.append(a[0].shape) or attention(*a)
    )

    def run() -> mx.array:
        cache = make_prompt_cache(model)
        out = [model(tokens[None, :100], cache=cache)[0]]
        out += [model(tokens[None, t : t + 1], cache=cache)[0] for t in range(100, 120)]
        return mx.concatenate(out, axis=0)

    got = run()
    assert calls and calls[0][2] == 100 and calls[-1][2] == 1  # prefill rows, then decode
    monkeypatch.setattr(cpu_attention, "enabled", False)
    calls.clear()
    want = run()
    assert not calls
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item(), mx.abs(got - want).max()
    assert mx.array_equal(mx.argmax(got, -1), mx.argmax(want, -1))
