"""One-row products through weights as stored (app/engine/packed_rows.py and .c):
exact against the dequantized weight, on any number of threads, with two callers at
once and after a fork; and a quantized model's decode steps through them give the
logits and the replies of its float32 weights."""

from __future__ import annotations

import os
import platform
import sys
import threading
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from children import assert_child_succeeds
from test_cpu_layers import _SMALL, FAMILIES, logits_of_steps

from app.engine import cpu_blas, cpu_layers, loading, packed_rows
from app.engine.chat import ChatSession
from app.engine.generation import SamplingSettings, TextDelta

pytestmark = pytest.mark.skipif(
    not packed_rows.available(), reason="the compiled library was not built here"
)


def quantized_layer(rows: int, columns: int, bits: int, group: int, seed: int = 0):
    """A layer with random codes, scales and biases: every code value occurs."""
    rng = np.random.default_rng(seed)
    layer = nn.QuantizedLinear(columns, rows, bias=False, group_size=group, bits=bits)
    shape = layer.weight.shape
    layer.weight = mx.array(rng.integers(0, 2**32, size=shape, dtype=np.uint32))
    layer.scales = mx.array(rng.standard_normal(layer.scales.shape).astype(np.float16))
    layer.biases = mx.array(rng.standard_normal(layer.biases.shape).astype(np.float16))
    return layer


def exact_weight(layer) -> np.ndarray:
    """scale * code + bias in float64, from the packed words (mlx's little-endian order)."""
    words = np.array(layer.weight)
    bits, per = layer.bits, 32 // layer.bits
    shifts = np.arange(per, dtype=np.uint32) * bits
    codes = (words[:, :, None] >> shifts) & ((1 << bits) - 1)
    codes = codes.reshape(len(words), -1).astype(np.float64)

    def spread(a):
        return np.repeat(np.array(a.astype(mx.float32), np.float64), layer.group_size, axis=1)

    return spread(layer.scales) * codes + spread(layer.biases)


def assert_product(got: np.ndarray, weight: np.ndarray, x: np.ndarray) -> None:
    """Within float32 rounding of each output's terms."""
    want = weight @ x
    scale = np.abs(weight) @ np.abs(x)
    assert np.all(np.abs(got - want) <= 1e-5 * scale)


@pytest.mark.parametrize("threads", [1, 2, 3, 64])
@pytest.mark.parametrize(("bits", "group"), [(4, 32), (4, 64), (4, 128), (8, 32), (8, 64)])
@pytest.mark.parametrize("rows", [1, 7, 130])
def test_a_product_is_the_dequantized_weight_s(bits, group, rows, threads):
    layer = quantized_layer(rows, 3 * group, bits, group)
    weight, exact = packed_rows.of_module(layer), exact_weight(layer)
    x = np.random.default_rng(1).standard_normal(3 * group).astype(np.float32)
    # Twice: a row left out of the second would hold the first's value, not this one's.
    for row in (x, -2 * x):
        assert_product(packed_rows.product(weight, row, threads), exact, row)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(("bits", "group"), [(4, 32), (4, 64), (8, 32)])
@pytest.mark.parametrize(("rows", "n"), [(7, 2), (130, 5), (130, 17), (9, 64)])
def test_a_few_rows_product_is_the_dequantized_weight_s(bits, group, rows, n, threads):
    """A short turn's rows through the codes at once (`rows_product`): partial blocks
    of the weight's rows and of x's, each output within float32 rounding."""
    layer = quantized_layer(rows, 3 * group, bits, group)
    weight, exact = packed_rows.of_module(layer), exact_weight(layer)
    x = np.random.default_rng(1).standard_normal((n, 3 * group)).astype(np.float32)
    got = packed_rows.rows_product(weight, x, threads)
    assert got.shape == (n, rows)
    for i in range(n):
        assert_product(got[i], exact, x[i])


@pytest.mark.parametrize("n", [0, 1])
def test_fewer_than_two_rows_are_refused_before_the_c_is_called(n):
    """One row is `product`'s (the C lays out its x for it), none is nothing to do:
    neither reaches the many-rows product, which would read a one-row scratch."""
    layer = quantized_layer(8, 64, 4, 32)
    with pytest.raises(ValueError, match="rows of"):
        packed_rows.rows_product(packed_rows.of_module(layer), np.ones((n, 64), np.float32))


def test_two_callers_at_once_each_get_their_own_product():
    """The helpers serve one product at a time; the other caller does its own alone."""
    layers = [quantized_layer(512, 256, 4, 64, seed) for seed in range(2)]
    weights = [packed_rows.of_module(layer) for layer in layers]
    exact = [exact_weight(layer) for layer in layers]
    xs = [np.random.default_rng(seed).standard_normal(256).astype(np.float32) for seed in (3, 4)]
    wrong = []

    def multiply(i: int) -> None:
        for _ in range(300):
            got = packed_rows.product(weights[i], xs[i], 2)
            if not np.allclose(got, exact[i] @ xs[i], rtol=1e-4, atol=1e-3):
                wrong.append(i)

    callers = [threading.Thread(target=multiply, args=(i,)) for i in (0, 1)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert wrong == []


def test_helpers_parked_at_any_moment_still_serve_every_product():
    """A short turn parks the helpers (they sleep instead of waiting on) while another
    thread's products may be under way: each product still comes out right, and
    none waits for a helper that went to sleep."""
    layer = quantized_layer(512, 256, 4, 64)
    weight, exact = packed_rows.of_module(layer), exact_weight(layer)
    x = np.random.default_rng(5).standard_normal(256).astype(np.float32)
    wrong, done = [], threading.Event()

    def multiply() -> None:
        for _ in range(2000):
            if not np.allclose(packed_rows.product(weight, x, 2), exact @ x, 1e-4, 1e-3):
                wrong.append(1)
        done.set()

    caller = threading.Thread(target=multiply)
    caller.start()
    while not done.is_set():
        packed_rows.park_helpers()
    caller.join(timeout=60)
    assert done.is_set() and wrong == []


def test_a_forked_child_multiplies_without_the_parent_s_helpers():
    """A child of fork has no helper threads: its product must not wait for them."""
    layer = quantized_layer(256, 128, 8, 32)
    weight, exact = packed_rows.of_module(layer), exact_weight(layer)
    x = np.ones(128, np.float32)
    packed_rows.product(weight, x, 2)  # the parent's helpers are running
    child = os.fork()
    if child == 0:
        right = np.allclose(packed_rows.product(weight, x, 2), exact @ x, rtol=1e-4, atol=1e-3)
        os._exit(0 if right else 1)
    assert_child_succeeds(child, "product")


@pytest.mark.parametrize(("bits", "group"), [(3, 32), (6, 64), (2, 32)])
def test_other_widths_keep_the_float32_product(bits, group):
    assert packed_rows.of_module(quantized_layer(8, 128, bits, group)) is None


def quantized_tiny(family: str, bits: int):
    """A tiny model of `family`, quantized, then loaded as the CPU path loads one."""
    module, extra = FAMILIES[family]
    mx.random.seed(3)
    model = module.Model(module.ModelArgs(model_type=family.split("-")[0], **_SMALL, **extra))
    nn.quantize(model, group_size=32, bits=bits)
    mx.eval(model.parameters())
    loading._dequantize(model, mx.float32)
    mx.eval(model.parameters())
    cpu_blas.install(model)
    assert cpu_layers.install(model) == 2
    return model


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("family", ["llama-biases-llama3-rope", "phi3", "qwen3"])
def test_a_quantized_model_s_steps_give_its_float32_weights_logits(family, bits, monkeypatch):
    """Biases, Phi-3's fused projections read as row ranges, Qwen3's tied output
    layer (the embedding's codes): each one-row product through the codes (kept
    whatever this CPU: the test is of the products, not of the choice)."""
    monkeypatch.setattr(packed_rows, "faster_here", lambda: True)
    model = quantized_tiny(family, bits)
    calls = []
    product = packed_rows.product
    monkeypatch.setattr(packed_rows, "product", lambda *a: calls.append(1) or product(*a))
    rng = np.random.default_rng(5)
    prompt, fed = rng.integers(0, 300, 80).tolist(), rng.integers(0, 300, 4).tolist()
    got = logits_of_steps(model, prompt, fed, None)
    assert len(calls) == 4 * (2 * 7 + 1)  # 4 steps: 7 products a block, 2 blocks, the head
    monkeypatch.setattr(packed_rows, "enabled", False)
    want = logits_of_steps(model, prompt, fed, None)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("family", ["llama-biases-llama3-rope", "phi3", "qwen3"])
def test_a_quantized_model_s_short_turn_gives_its_float32_weights_logits(family, bits, monkeypatch):
    """A follow-up's prompt of 7 rows after a prefill of 80: its projections through
    the codes at once (chosen whatever this CPU: the test is of the products), the
    logits of its float32 weights; the prefill's 80 rows stay float32 products."""
    monkeypatch.setattr(packed_rows, "faster_here", lambda: True)
    monkeypatch.setattr(cpu_layers, "_many_rows_fast", lambda: True)
    model = quantized_tiny(family, bits)
    calls = []
    rows_product = packed_rows.rows_product
    monkeypatch.setattr(packed_rows, "rows_product", lambda *a: calls.append(1) or rows_product(*a))
    rng = np.random.default_rng(5)
    prompt, fed = rng.integers(0, 300, 80).tolist(), [rng.integers(0, 300, 7).tolist()]
    got = logits_of_steps(model, prompt, fed, None)
    assert len(calls) == 2 * 7  # the 7-row call: 7 products a block, 2 blocks
    monkeypatch.setattr(packed_rows, "enabled", False)
    want = logits_of_steps(model, prompt, fed, None)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_the_starter_model_replies_the_same_through_its_codes(starter_model, monkeypatch):
    """What a user sees: the same greedy reply whether the decode steps read the
    stored 4- and 8-bit codes or the float32 weights."""
    if not packed_rows.faster_here():
        pytest.skip("this CPU keeps float32 products (no AVX2 and FMA for the codes')")
    assert starter_model.model.model.layers[0].mlp.down_proj.packed_weight.bits == 4
    assert starter_model.model.model.embed_tokens.packed_weight.bits == 8
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]

    def reply() -> str:
        events = ChatSession(starter_model).reply(messages, sampling=SamplingSettings.greedy(24))
        return "".join(e.text for e in events if isinstance(e, TextDelta))

    got = reply()
    monkeypatch.setattr(packed_rows, "enabled", False)
    assert got == reply()
    assert len(got.split()) >= 5


def test_codes_and_scales_that_disagree_keep_the_float32_product():
    """A model's files set the shapes: the C is never handed words it would read past."""
    layer = quantized_layer(8, 128, 4, 32)
    layer.scales = layer.scales[:, :3]  # a group short
    assert packed_rows.of_module(layer) is None
    layer = quantized_layer(8, 128, 4, 32)
    layer.biases = layer.biases[:7]
    assert packed_rows.of_module(layer) is None


@pytest.mark.skipif(
    platform.machine() != "x86_64" or sys.platform != "linux", reason="reads /proc/cpuinfo"
)
def test_codes_are_kept_where_this_cpu_runs_their_fast_build(monkeypatch):
    """Their portable build is slower than float32 sgemv, so a CPU without AVX2 and FMA
    keeps float32 products, unless REPRISE_PACKED_ROWS=on; off keeps them anywhere."""
    flags = next(
        line.split()
        for line in Path("/proc/cpuinfo").read_text().splitlines()
        if line.startswith("flags")
    )
    assert packed_rows.faster_here() == ("avx2" in flags and "fma" in flags)
    monkeypatch.setattr(packed_rows, "_SWITCH", "on")
    assert packed_rows.faster_here()
    monkeypatch.setattr(packed_rows, "enabled", False)
    assert not packed_rows.faster_here()


def test_a_cpu_without_the_fast_build_keeps_float32_products(monkeypatch):
    """No codes kept (no memory spent on them), every one-row product through sgemv."""
    monkeypatch.setattr(packed_rows, "faster_here", lambda: False)
    model = quantized_tiny("qwen3", 4)
    assert getattr(model.model.layers[0].mlp.down_proj, "packed_weight", None) is None
    calls = []
    product = packed_rows.product
    monkeypatch.setattr(packed_rows, "product", lambda *a: calls.append(1) or product(*a))
    logits_of_steps(model, list(range(80)), [5, 6], None)
    assert calls == []


@pytest.mark.parametrize(
    "family", ["sliding", "hybrid-qwen3-next", "hybrid-granite", "mla", "chunked", "cachelist"]
)
def test_every_family_quantized_decodes_as_through_its_float32_weights(
    family, starter_model_dir, tmp_path, monkeypatch
):
    """Sliding-window, hybrid, MLA, chunked and CacheList models, quantized, loaded as
    the CPU path loads them: their one-row products go through the codes, and each
    step's logits are those of the float32 weights."""
    import json

    import families
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import make_prompt_cache

    monkeypatch.setattr(packed_rows, "faster_here", lambda: True)
    folder = families.build(family, starter_model_dir, tmp_path)
    model = loading.load(folder, compute="stored").model
    # The layers whose codes the products read (MLA's own stacked layers stay dense).
    nn.quantize(model, 32, 4, class_predicate=lambda _, m: type(m) in (nn.Linear, nn.Embedding))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, {"format": "mlx"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))
    model = loading.load(folder, compute="dense").model
    assert any(getattr(m, "packed_weight", None) for _, m in model.named_modules())

    def steps() -> np.ndarray:
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([list(range(5, 90))]), cache=cache))
        return np.concatenate([np.array(model(mx.array([[t]]), cache=cache)) for t in (7, 8, 9)])

    got = steps()
    monkeypatch.setattr(packed_rows, "enabled", False)
    want = steps()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
