"""The codes path (`loading`'s compute "codes"): float32 compute, the projections of
the layers `cpu_layers` knows kept as their 4- or 8-bit codes. What a user notices:
the same replies as from float32 weights, in a fraction of the memory, and a model
too big for float32 weights running this way rather than as stored."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from test_cpu_layers import _SMALL, FAMILIES, logits_of_steps

from app.engine import cpu_blas, cpu_layers, loading, packed_rows
from app.engine.chat import ChatSession
from app.engine.generation import SamplingSettings, TextDelta


def tiny_quantized(family: str, bits: int, codes: bool):
    """A tiny model of `family`, quantized, loaded as the dense or the codes path loads it."""
    module, extra = FAMILIES[family]
    mx.random.seed(3)
    model = module.Model(module.ModelArgs(model_type=family.split("-")[0], **_SMALL, **extra))
    nn.quantize(model, group_size=32, bits=bits)
    mx.eval(model.parameters())
    loading._dequantize(model, mx.float32, cpu_layers.codes_layers(model) if codes else ())
    mx.eval(model.parameters())
    cpu_blas.install(model)
    assert cpu_layers.install(model) == 2
    return model


def weight_bytes(model) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


@pytest.mark.parametrize("kv_bits", [None, 4])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_gives_the_float32_weights_logits_from_its_codes(family, bits, kv_bits):
    """A prompt of 150 rows (one call: the codes widened for BLAS), then follow-ups of
    7, 1, 1, 2 and 1 rows, against the same model with float32 weights."""
    codes = tiny_quantized(family, bits, codes=True)
    dense = tiny_quantized(family, bits, codes=False)
    assert weight_bytes(codes) < weight_bytes(dense)
    rng = np.random.default_rng(5)
    prompt, fed = rng.integers(0, 300, 150).tolist(), rng.integers(0, 300, 12).tolist()
    fed = [fed[:7], *fed[7:9], fed[9:11], fed[11]]
    got = logits_of_steps(codes, prompt, fed, kv_bits)
    want = logits_of_steps(dense, prompt, fed, kv_bits)
    tolerance = 1e-4 if kv_bits is None else 1e-3  # a rounding apart: the next code
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=tolerance * np.abs(want).max())


def test_the_starter_model_replies_the_same_in_a_fifth_of_the_memory(
    starter_model, starter_model_dir
):
    codes = loading.load(starter_model_dir, compute="codes")
    assert codes.compute.codes and "4/8-bit codes" in codes.compute.describe()
    assert weight_bytes(codes.model) < 0.25 * weight_bytes(starter_model.model)
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]

    def reply(loaded) -> str:
        events = ChatSession(loaded).reply(messages, sampling=SamplingSettings.greedy(24))
        return "".join(e.text for e in events if isinstance(e, TextDelta))

    got = reply(codes)
    assert got == reply(starter_model)
    assert len(got.split()) >= 5


@pytest.mark.parametrize(
    ("memory_mb", "expected"),
    [(8000, "float32 (dequantized"), (1000, "float32, its layers as"), (250, "as stored")],
)
def test_a_model_too_big_for_float32_keeps_its_codes_where_they_fit(
    memory_mb, expected, starter_model_dir, monkeypatch
):
    """The starter's float32 weights are 540 MB, its codes path's 115 MB: with 40% of
    8 GB it is dequantized, of 1 GB it keeps its codes, of 250 MB it runs as stored."""
    monkeypatch.setattr(loading, "_physical_memory", lambda: memory_mb * 10**6)
    monkeypatch.setattr(packed_rows, "faster_here", lambda: True)
    loaded = loading.load(starter_model_dir)
    assert loaded.compute.weights.startswith(expected)
    assert loaded.compute.codes == expected.startswith("float32, its")
    if memory_mb < 8000:
        assert "more than 40% of memory" in loaded.compute.note


def test_without_the_fast_build_a_model_too_big_for_float32_runs_as_stored(
    starter_model_dir, monkeypatch
):
    monkeypatch.setattr(loading, "_physical_memory", lambda: 10**9)
    monkeypatch.setattr(packed_rows, "faster_here", lambda: False)
    assert loading.load(starter_model_dir).compute.weights.startswith("as stored")


def test_without_the_compiled_products_asking_for_codes_runs_as_stored(
    starter_model_dir, monkeypatch
):
    monkeypatch.setattr(packed_rows, "available", lambda: False)
    loaded = loading.load(starter_model_dir, compute="codes")
    assert loaded.compute.weights.startswith("as stored") and not loaded.compute.codes


def test_without_openblas_a_model_too_big_for_float32_runs_as_stored(
    starter_model_dir, monkeypatch
):
    monkeypatch.setattr(loading, "_physical_memory", lambda: 10**9)
    monkeypatch.setattr(packed_rows, "faster_here", lambda: True)
    monkeypatch.setattr(cpu_blas, "available", lambda: False)
    assert loading.load(starter_model_dir).compute.weights.startswith("as stored")


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_the_memory_the_choice_counts_is_what_the_codes_path_holds(family, monkeypatch):
    """Known blocks (Qwen3) keep their codes; others (Gemma 2) are float32 and keep no
    codes beside it, as the estimate the choice is made on assumes."""
    from mlx_lm.models import gemma2

    from app.bench.compute_paths import weight_bytes as held

    monkeypatch.setattr(packed_rows, "faster_here", lambda: True)
    if family == "gemma2":
        args = gemma2.ModelArgs(model_type="gemma2", **_SMALL, head_dim=32)
        model = gemma2.Model(args)
    else:
        module, extra = FAMILIES[family]
        model = module.Model(module.ModelArgs(model_type=family, **_SMALL, **extra))
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    estimate = loading._codes_path_bytes(model)
    loading._dequantize(model, mx.float32, cpu_layers.codes_layers(model))
    cpu_blas.install(model)

    class Loaded:  # what `held` reads
        pass

    loaded = Loaded()
    loaded.model = model
    widened = [  # what a product of many rows widens: the blocks' projections
        4 * m.packed_weight.shape[0] * m.packed_weight.shape[1]
        for name, m in model.named_modules()
        if isinstance(m, cpu_blas.CodesLinear) and not name.endswith("lm_head")
    ]
    scratch = max(widened, default=0)
    assert (scratch > 0) == (family == "qwen3")
    assert held(loaded) + scratch == pytest.approx(estimate, rel=0.01)
