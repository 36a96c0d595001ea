"""A decode step's layers in numpy (app/engine/cpu_layers.py) against mlx's own layers:
the same logits step after step, for each family it takes and each KV setting, and
the starter model's replies."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import gemma2, gemma3_text, llama, phi3, qwen2, qwen3
from mlx_lm.models.cache import make_prompt_cache

from app.engine import cpu_blas, cpu_layers
from app.engine.chat import ChatSession
from app.engine.generation import KVSettings, SamplingSettings, TextDelta
from app.engine.kvconvert import quantizer
from app.engine.kvscheme import scheme_for

pytestmark = pytest.mark.skipif(
    not cpu_blas.available(), reason="the numpy layers are for the CPU path only"
)

_SMALL = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 300,
}
FAMILIES = {
    "llama": (llama, {"tie_word_embeddings": False}),
    "llama-biases-llama3-rope": (
        llama,
        {
            "attention_bias": True,
            "mlp_bias": True,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "llama-sliding": (
        llama,
        {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16},
    ),
    "qwen2": (qwen2, {"rope_theta": 1e6}),
    "phi3": (
        phi3,
        {  # Su-scaled rope on half of each head
            "partial_rotary_factor": 0.5,
            "max_position_embeddings": 4096,
            "original_max_position_embeddings": 512,
            "rope_scaling": {
                "type": "longrope",
                "long_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0],
                "short_factor": [1.0] * 8,
            },
        },
    ),
    "gemma3_text": (  # a sliding layer with its own rope base, then a global one
        gemma3_text,
        {
            "head_dim": 32,
            "query_pre_attn_scalar": 24,
            "sliding_window": 16,
            "sliding_window_pattern": 2,
        },
    ),
    "qwen3": (
        qwen3,
        {
            "head_dim": 32,
            "max_position_embeddings": 4096,
            "rope_theta": 1e6,
            "tie_word_embeddings": True,
        },
    ),
}


def tiny(family: str):
    module, extra = FAMILIES[family]
    mx.random.seed(3)
    args = module.ModelArgs(model_type=family.split("-")[0], **_SMALL, **extra)
    model = module.Model(args)
    mx.eval(model.parameters())
    cpu_blas.install(model)
    assert cpu_layers.install(model) == 2
    return model


def logits_of_steps(model, prompt: list[int], fed: list, bits: int | None) -> np.ndarray:
    """Prefill `prompt` in one call, then feed each of `fed` (a token, or a few in one
    call, as a short follow-up's prompt); the logits of every fed token, the cache
    quantized after every call as the engine does."""
    cache = make_prompt_cache(model)
    quantize = quantizer(scheme_for(bits, 32), 0)
    model(mx.array(prompt)[None], cache=cache)
    quantize(cache)
    every = []
    for tokens in fed:
        every.append(np.array(model(mx.array(tokens).reshape(1, -1), cache=cache)[0]))
        quantize(cache)
    return np.concatenate(every)


@pytest.mark.parametrize("bits", [None, 8, 4])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_step_gives_the_logits_of_mlxs_layers(family, bits, monkeypatch):
    """Past the 16-bit window of the 8- and 4-bit caches (4 + 128 rows), so the packed
    bulk is read, and past the sliding window of 16."""
    model = tiny(family)
    rng = np.random.default_rng(5)
    prompt, fed = rng.integers(0, 300, 150).tolist(), rng.integers(0, 300, 12).tolist()
    fed = [fed[:7], *fed[7:9], fed[9:11], fed[11]]  # rows of 7, 1, 1, 2 and 1
    got = logits_of_steps(model, prompt, fed, bits)
    monkeypatch.setattr(cpu_layers, "enabled", False)
    want = logits_of_steps(model, prompt, fed, bits)
    # Quantized: a key a rounding apart can land on the next code, one step of its group.
    tolerance = 1e-4 if bits is None else 1e-3
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=tolerance * np.abs(want).max())


def test_each_call_runs_in_numpy(monkeypatch):
    model = tiny("qwen3")
    layers = []
    attention = cpu_layers._attention
    monkeypatch.setattr(cpu_layers, "_attention", lambda *a: layers.append(1) or attention(*a))
    logits_of_steps(model, list(range(100)), [1, [2, 3, 4], 5], None)
    assert len(layers) == 4 * 2  # the long prompt and three steps, two layers each


def test_other_blocks_and_other_precisions_keep_mlxs_layers():
    args = gemma2.ModelArgs(
        model_type="gemma2", **_SMALL, head_dim=32, query_pre_attn_scalar=32
    )  # its attention caps the scores' size: not a layout here
    assert cpu_layers.install(gemma2.Model(args)) == 0
    model = llama.Model(llama.ModelArgs(model_type="llama", **_SMALL))
    model.set_dtype(mx.float16)
    assert cpu_layers.install(model) == 0
    assert type(model.model.layers[0]) is llama.TransformerBlock


def test_the_starter_model_replies_the_same_with_each_kv_setting(starter_model, monkeypatch):
    """What a user sees: the same greedy reply, through the chat engine, with numpy's
    layers and with mlx's, in 16 bits and with the Memory preference on."""
    assert type(starter_model.model.model.layers[0]).__name__ == "RowTransformerBlock"
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]

    def reply(kv: KVSettings) -> str:
        session = ChatSession(starter_model)
        events = session.reply(messages, sampling=SamplingSettings.greedy(14), kv=kv)
        return "".join(e.text for e in events if isinstance(e, TextDelta))

    settings = [KVSettings(), KVSettings(bits=8), KVSettings(bits=4)]
    got = [reply(kv) for kv in settings]
    monkeypatch.setattr(cpu_layers, "enabled", False)
    want = [reply(kv) for kv in settings]
    assert got == want
    assert all(len(text.split()) >= 5 for text in got)


def test_models_whose_ropes_differ_only_past_their_maximum_keep_their_own_rotations(
    monkeypatch,
):
    """A dynamic rope changes its base past the model's maximum position; two models
    alike but for that maximum, decoding one after the other at the same position
    (a switch of models), each rotate by their own."""

    def dynamic(maximum: int):
        mx.random.seed(3)
        scaling = {"rope_type": "dynamic", "factor": 4.0}
        args = llama.ModelArgs(
            model_type="llama", **_SMALL, rope_scaling=scaling, max_position_embeddings=maximum
        )
        model = llama.Model(args)
        mx.eval(model.parameters())
        cpu_blas.install(model)
        cpu_layers.install(model)
        return model

    first, second = dynamic(4200), dynamic(8192)
    prompt = np.random.default_rng(1).integers(0, 300, 5000).tolist()
    logits_of_steps(first, prompt, [7], None)
    got = logits_of_steps(second, prompt, [7], None)
    monkeypatch.setattr(cpu_layers, "enabled", False)
    want = logits_of_steps(second, prompt, [7], None)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_rotations_turn_pairs_and_anything_else_is_multiplied_as_a_matrix():
    """A rope's matrices become pairs of dimensions (two products a value); matrices
    that are not pairs stay a matrix product. Either gives x @ M."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 4, 32)).astype(np.float32)
    rope = tiny("phi3").model.layers[0].self_attn.rope  # a partial, scaled rotation
    for matrices, pairs in (
        (cpu_layers._rope_matrices(rope, 32, 4000, 3), True),
        (rng.standard_normal((3, 32, 32)).astype(np.float32), False),
    ):
        rotation = cpu_layers._Rotation.of(matrices)
        assert (rotation.partner is not None) == pairs
        want = np.einsum("rhi,rij->rhj", x, matrices)
        np.testing.assert_allclose(rotation(x), want, rtol=1e-5, atol=1e-5)
