"""A decode step's products through OpenBLAS's sgemv (app/engine/cpu_blas.py) against
mlx's own matmul: the products alone, the layers that use them, and a model's replies."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from app.engine import cpu_attention, cpu_blas, cpu_layers

pytestmark = pytest.mark.skipif(
    not cpu_blas.available(), reason="the products go through OpenBLAS on the CPU path only"
)


def normal(*shape: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


@pytest.mark.parametrize("rows", [1, 3, 4, 9])
@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize("tokens", [500, 4100])  # sgemm, then sgemv per row below 4 rows
def test_products_equal_numpys_for_few_and_many_rows(rows, transposed, tokens):
    a = normal(rows, 64, seed=1)
    # Slices of larger buffers (rows further apart than they are long), as a KV cache
    # hands out, read as they are or through a transposed view.
    if transposed:
        b = normal(tokens, 100, seed=2)[:, :64].T
    else:
        b = normal(64, tokens + 200, seed=2)[:, :tokens]
    np.testing.assert_allclose(cpu_blas.matmul(a, b), a @ b, rtol=1e-4, atol=1e-4)


def test_matrices_blas_cannot_read_in_place_are_copied_first():
    a = normal(5, 64, seed=3)
    every_other_column = normal(64, 50, seed=4)[:, ::2]
    broadcast = np.broadcast_to(normal(1, 25, seed=5), (64, 25))  # every row the same
    for b in (every_other_column, broadcast, every_other_column.T.T):
        np.testing.assert_allclose(cpu_blas.matmul(a, b), a @ b, rtol=1e-4, atol=1e-4)
        out = np.zeros((5, 60), np.float32)[:, ::2][:, :25]  # columns apart
        cpu_blas.matmul(a, b, out)
        np.testing.assert_allclose(out, a @ b, rtol=1e-4, atol=1e-4)


def test_stacks_of_matrices_equal_numpys():
    a, b = normal(2, 3, 4, 64, seed=6), normal(2, 3, 64, 30, seed=7)
    np.testing.assert_allclose(cpu_blas.stacked_matmul(a, b), a @ b, rtol=1e-4, atol=1e-4)
    one = normal(64, 64, seed=8)
    np.testing.assert_allclose(cpu_blas.stacked_matmul(a, one), a @ one, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bias", [False, True])
def test_a_row_linear_gives_mlxs_product_for_one_row_and_mlxs_own_for_more(bias):
    plain = nn.Linear(96, 200, bias=bias)
    row = cpu_blas._row_layer("", plain)
    assert isinstance(row, cpu_blas.RowLinear)
    one = mx.random.normal((1, 1, 96), key=mx.random.key(7))
    assert mx.allclose(row(one), plain(one), atol=1e-5, rtol=1e-5).item()
    assert row(one).shape == (1, 1, 200)
    many = mx.random.normal((1, 5, 96), key=mx.random.key(8))
    assert mx.array_equal(row(many), plain(many)).item()  # prefill: mlx, untouched


def test_a_tied_output_layer_gives_mlxs_logits():
    plain = nn.Embedding(1000, 64)
    row = cpu_blas._row_layer("", plain)
    assert isinstance(row, cpu_blas.RowEmbedding)
    h = mx.random.normal((1, 1, 64), key=mx.random.key(9))
    assert mx.allclose(row.as_linear(h), plain.as_linear(h), atol=1e-5, rtol=1e-5).item()
    ids = mx.array([[3, 999]])
    assert mx.array_equal(row(ids), plain(ids)).item()


def test_other_layers_and_half_precision_rows_are_left_to_mlx():
    quantized = nn.QuantizedLinear(64, 64)
    assert cpu_blas._row_layer("", quantized) is quantized
    row = cpu_blas._row_layer("", nn.Linear(64, 32))
    x = mx.random.normal((1, 64)).astype(mx.float16)
    assert not cpu_blas._one_row(x, row.weight)


def greedy_reply(model, prompt: mx.array, steps: int) -> tuple[list[int], mx.array]:
    cache = make_prompt_cache(model)
    logits = model(prompt[None], cache=cache)[:, -1]
    tokens, every = [], []
    for _ in range(steps):
        every.append(logits)
        tokens.append(mx.argmax(logits, -1).item())
        logits = model(mx.array([[tokens[-1]]]), cache=cache)[:, -1]
    return tokens, mx.concatenate(every)


def test_the_starter_model_replies_the_same_through_sgemv_as_through_mlx(
    starter_model, monkeypatch
):
    """The loaded model's dense layers and its tied output layer take sgemv in decode
    steps, and give the reply mlx's matmul gives."""
    model = starter_model.model
    monkeypatch.setattr(cpu_layers, "enabled", False)  # the blocks' own numpy step
    assert isinstance(model.model.layers[0].mlp.down_proj, cpu_blas.RowLinear)
    assert isinstance(model.model.embed_tokens, cpu_blas.RowEmbedding)
    prompt = mx.array(starter_model.tokenizer.encode("The capital of France is"))
    calls = []
    product = cpu_blas.row_times_transposed
    monkeypatch.setattr(cpu_blas, "row_times_transposed", lambda *a: calls.append(1) or product(*a))
    got, got_logits = greedy_reply(model, prompt, 12)
    assert len(calls) == 12 * (30 * 7 + 1)  # each decode call: 7 layers a block, the head
    monkeypatch.setattr(cpu_blas, "enabled", False)
    monkeypatch.setattr(cpu_attention, "enabled", False)
    want, want_logits = greedy_reply(model, prompt, 12)
    assert got == want
    assert mx.allclose(got_logits, want_logits, atol=2e-3, rtol=1e-3).item()


def test_a_product_over_no_tokens_is_empty_or_zero():
    """A cache with no 16-bit rows yet hands the attention empty matrices."""
    assert cpu_blas.matmul(normal(3, 64, seed=9), np.empty((64, 0), np.float32)).shape == (3, 0)
    nothing = cpu_blas.matmul(np.empty((3, 0), np.float32), np.empty((0, 5), np.float32))
    assert nothing.shape == (3, 5) and not nothing.any()
