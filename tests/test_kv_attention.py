"""Attention read from the packed KV cache (app/engine/kvattention.py, kvkernels.py)
against its oracle: every token dequantized, then mlx's fused attention.

Runs on whatever device mlx uses: the CPU here, the CUDA kernel on a GPU machine
(`python -m pytest tests/test_kv_attention.py` there; see shared/tools)."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from app.engine import kvattention, kvcpu, kvkernels, kvnative
from app.engine.kvconvert import quantizer
from app.engine.kvquant import MixedKVCache
from app.engine.kvscheme import APP_SCHEMES, KVScheme, scheme_for

# (head size, query heads, KV heads): grouped-query ratios 1, 2, 4 and 8.
SHAPES = [(32, 4, 2), (64, 4, 4), (64, 8, 4), (128, 16, 4), (128, 16, 2), (128, 8, 8)]
DTYPES = [mx.float32] if mx.default_device() == mx.cpu else [mx.bfloat16, mx.float16, mx.float32]


def filled(scheme: KVScheme, kv_heads: int, dim: int, dtype, tokens=(300, 77), **window):
    """A layer after a prefill of `tokens[0]` and `tokens[1]` single decode steps."""
    layer = MixedKVCache(scheme, **window)
    total = sum(tokens)
    keys = mx.random.normal((1, kv_heads, total, dim), key=mx.random.key(1))
    keys = keys * mx.where(mx.arange(dim) == 3, 12.0, 1.0)  # an outlier channel
    values = mx.random.normal((1, kv_heads, total, dim), key=mx.random.key(2))
    steps = [(0, tokens[0]), *((t, t + 1) for t in range(tokens[0], total))]
    for start, stop in steps:
        layer.update_and_fetch(
            keys[..., start:stop, :].astype(dtype), values[..., start:stop, :].astype(dtype)
        )
    mx.eval(layer.state)
    return layer


def oracle(layer: MixedKVCache, queries: mx.array, mask=None) -> mx.array:
    keys, values = (layer.reference_read(part, queries.dtype) for part in (0, 1))
    scale = queries.shape[-1] ** -0.5
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def close(got: mx.array, want: mx.array) -> bool:
    tolerance = 1e-4 if want.dtype == mx.float32 else 2e-2  # bfloat16 keeps 8 bits
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    return mx.allclose(got, want, atol=tolerance, rtol=tolerance).item()


def schemes(dim: int) -> list[KVScheme]:
    """The app's 8-bit and 4-bit at every group size that fits the head size (the
    group size equal to the head size included: mlx's CUDA matmul is wrong there)."""
    return [
        replace(scheme, group_size=group)
        for scheme in APP_SCHEMES.values()
        for group in (32, 64, 128)
        if group <= dim
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("dim", "heads", "kv_heads"), SHAPES, ids=str)
def test_decode_from_the_packed_cache_matches_the_dequantized_oracle(dim, heads, kv_heads, dtype):
    for scheme in schemes(dim):
        layer = filled(scheme, kv_heads, dim, dtype)
        assert layer.quantized() > 0 and len(layer.exact[0]) > scheme.sink
        queries = mx.random.normal((1, heads, 1, dim), key=mx.random.key(3)).astype(dtype)
        got = layer.attend(queries, dim**-0.5, None)
        assert got.shape == queries.shape and got.dtype == dtype
        want = oracle(layer, queries)
        error = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
        assert close(got, want), (scheme.format, dim, heads, kv_heads, error)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mixed_widths_and_plain_schemes_match_the_oracle(dtype):
    for scheme in (KVScheme(8, 4, 64), KVScheme(4, 8, 32, sink=4, window=16, rotate_keys=True)):
        layer = filled(scheme, 2, 64, dtype, tokens=(128, 70))
        queries = mx.random.normal((1, 8, 1, 64), key=mx.random.key(4)).astype(dtype)
        assert close(layer.attend(queries, 0.125, None), oracle(layer, queries)), scheme.format


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_sliding_window_layer_attends_over_what_it_keeps(dtype):
    scheme = replace(APP_SCHEMES["4-bit"], window=32)
    layer = filled(scheme, 2, 64, dtype, tokens=(200, 90), max_size=256, keep=4)
    assert layer.stored() == 256 and layer.quantized() > 0  # old tokens were dropped
    queries = mx.random.normal((1, 4, 1, 64), key=mx.random.key(5)).astype(dtype)
    assert close(layer.attend(queries, 0.125, None), oracle(layer, queries))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_with_a_mask_matches_the_oracle(dtype):
    layer = filled(APP_SCHEMES["8-bit"], 4, 128, dtype, tokens=(400, 3))
    queries = mx.random.normal((1, 8, 16, 128), key=mx.random.key(6)).astype(dtype)
    mask = (
        mx.arange(layer.stored())[None] <= mx.arange(layer.stored() - 16, layer.stored())[:, None]
    )
    got = layer.attend(queries, 128**-0.5, mask)
    assert close(got, oracle(layer, queries, mask))


@pytest.mark.skipif(not kvkernels.available(), reason="the kernel is for mlx's CUDA backend")
def test_on_cuda_decode_runs_our_kernel_for_every_app_scheme():
    for dim, heads, kv_heads in SHAPES:
        for scheme in schemes(dim):
            layer = filled(scheme, kv_heads, dim, mx.bfloat16, tokens=(200, 1))
            queries = mx.zeros((1, heads, 1, dim), mx.bfloat16)
            assert kvkernels.supports(layer.layout(), queries), (scheme.format, dim)


class ReferenceCache(MixedKVCache):
    """The oracle inside a model: attention always gets the dequantized arrays."""

    def update_and_fetch(self, keys, values):
        super().update_and_fetch(keys, values)
        self.handshake = None
        return self.reference_read(0, keys.dtype), self.reference_read(1, values.dtype)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_model_reads_its_packed_cache_and_gets_the_oracles_logits(tiny_model, bits):
    model = tiny_model.model
    scheme = replace(scheme_for(bits, 32), window=16)
    tokens = mx.random.randint(3, 200, (200,), key=mx.random.key(7))

    def run(cache: list) -> mx.array:
        # Few decode steps: over many, the two caches drift apart (each quantizes the
        # keys its own model computed, and a rounding can flip a 4-bit code).
        out = [model(tokens[None, :180], cache=cache)[0]]
        out += [model(tokens[None, t : t + 1], cache=cache)[0] for t in range(180, 200)]
        return mx.concatenate(out, axis=0)

    packed = make_prompt_cache(model)
    quantizer(scheme)(packed)
    reference = [ReferenceCache(scheme) for _ in packed]
    got, want = run(packed), run(reference)
    assert all(layer.packed_reads for layer in packed)  # the patched attention took over
    assert kvattention.scaled_dot_product_attention is not kvattention._original
    assert mx.allclose(got, want, atol=5e-3, rtol=1e-3).item(), mx.abs(got - want).max()
    assert mx.array_equal(mx.argmax(got, -1), mx.argmax(want, -1))


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the CPU's decode path")
def test_on_the_cpu_decode_reads_the_codes_without_widening_the_bulk(monkeypatch):
    """The CPU's decode step takes its products with the codes (`cpu_decode`); the
    dense path, which widens the whole bulk into a float32 copy every step, is not
    reached (it cost 2-3x the time per layer)."""

    def widened(*_args, **_kwargs):
        raise AssertionError("the bulk was widened for a decode step")

    monkeypatch.setattr(kvattention, "widen", widened)
    for scheme in APP_SCHEMES.values():
        layer = filled(scheme, 2, 64, mx.float32)
        queries = mx.random.normal((1, 4, 1, 64), key=mx.random.key(7))
        assert close(layer.attend(queries, 0.125, None), oracle(layer, queries)), scheme.format


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the CPU's decode path")
@pytest.mark.parametrize(("dim", "heads", "kv_heads"), [(64, 9, 3), (128, 16, 2)], ids=str)
def test_on_the_cpu_a_bulk_of_many_blocks_and_16_bit_halves_match_the_oracle(
    monkeypatch, dim, heads, kv_heads
):
    """`kvcpu` widens the bulk a block at a time: many small blocks (with a partial
    last one) give what one does, a half kept in 16 bits is read as such, and a
    layer without a sink or window can hold no 16-bit row at all (224 = 7 x FLUSH).
    The numpy path's (the compiled one, kvnative, is tested in test_kv_native)."""
    monkeypatch.setattr(kvnative, "enabled", False)
    monkeypatch.setattr(kvcpu, "_BLOCK_BYTES", 4 * dim * 24)
    mixed = [KVScheme(8, None, 64, sink=4, window=16), KVScheme(None, 4, 32, 4, 16, True)]
    for scheme, tokens in [
        *((scheme, (200, 9)) for scheme in [*schemes(dim), *mixed]),
        (KVScheme(8, 4, 32), (200, 24)),
    ]:
        layer = filled(scheme, kv_heads, dim, mx.float32, tokens=tokens)
        queries = mx.random.normal((1, heads, 1, dim), key=mx.random.key(5))
        got = layer.attend(queries, dim**-0.5, None)
        assert close(got, oracle(layer, queries)), scheme.format


def test_bfloat16_rows_on_the_float32_path_match_the_oracle():
    """A cache holding bfloat16 rows (a bfloat16 model's, restored where the model
    computes in float32) is attended as any other: numpy, which reads the CPU's packed
    buffers, has no bfloat16, so such a layer takes the dense path."""
    for scheme in APP_SCHEMES.values():
        layer = filled(scheme, 2, 64, mx.bfloat16)
        queries = mx.random.normal((1, 4, 1, 64), key=mx.random.key(8))
        assert close(layer.attend(queries, 0.125, None), oracle(layer, queries)), scheme.format
