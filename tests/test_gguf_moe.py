"""A Qwen3-MoE GGUF file gives the mixture-of-experts model it was made from.

The reference is mlx-lm's own qwen3_moe model with random weights (4 experts, 2
used per token); its weights go into a GGUF file under llama.cpp's names, the
experts stacked in 3-D `ffn_*_exps` tensors, with the `qwen3moe.expert_*` keys
llama.cpp's converter writes. A router or an expert stack mapped wrongly, a
transposed expert, or top-k weights not renormalized changes the logits.
"""

from __future__ import annotations

import json

import gguf
import gguf_models as gm
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model

from app.engine.gguf_child import import_in_child
from app.engine.gguf_import import GGUFImportError
from app.engine.loading import load

_PROMPT = mx.array([[5, 70, 99, 3, 180, 260, 42, 11, 8, 17]])
_EXPERTS, _USED, _EXPERT_FFN = 4, 2, 64
_MOE = {
    "num_experts": _EXPERTS,
    "num_experts_per_tok": _USED,
    "moe_intermediate_size": _EXPERT_FFN,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
}


def _u32(value: int) -> mx.array:
    return mx.array(value, dtype=mx.uint32)


def _meta(config: dict, **overrides) -> dict:
    moe = {
        "qwen3moe.expert_count": _u32(_EXPERTS),
        "qwen3moe.expert_used_count": _u32(_USED),
        "qwen3moe.expert_feed_forward_length": _u32(_EXPERT_FFN),
    }
    return gm.metadata("qwen3moe", config, **moe | overrides)


def _model(**extra):
    config = gm.config("qwen3moe", False, **_MOE | extra)
    reference = gm.reference(config)
    return config, reference, gm.gguf_tensors(reference, "qwen3moe")


def test_imported_moe_model_gives_the_reference_logits(tmp_path):
    config, reference, tensors = _model()
    assert tensors["blk.0.ffn_gate_exps.weight"].shape == (_EXPERTS, _EXPERT_FFN, gm.HIDDEN)
    path = tmp_path / "moe.gguf"
    mx.save_gguf(str(path), tensors, _meta(config))

    imported = import_in_child(path, tmp_path / "models", "moe")

    written = json.loads((imported.path / "config.json").read_text())
    assert written["model_type"] == "qwen3_moe"
    assert {k: written[k] for k in _MOE} == _MOE
    model, _ = load_model(imported.path)
    expected, got = reference(_PROMPT), model(_PROMPT)
    np.testing.assert_allclose(np.array(got), np.array(expected), atol=1e-4, rtol=1e-4)
    loaded = load(imported.path)  # the app opens it too
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("the", add_special_tokens=False)) == (
        "the"
    )


def test_unnormalized_expert_weights_would_change_the_logits():
    """norm_topk_prob matters for these weights (so the test above would see it lost)."""
    _, reference, _ = _model()
    _, other, _ = _model(norm_topk_prob=False)
    assert float(mx.abs(reference(_PROMPT) - other(_PROMPT)).max()) > 1e-2


def _q8_experts(tmp_path):
    """A file whose expert stacks are Q8_0 blocks, and the reference given their values."""
    config, reference, tensors = _model()
    raw, exact = {}, {}
    for name, value in tensors.items():
        if "_exps" in name:
            data = gguf.quants.quantize(np.array(value), gguf.GGMLQuantizationType.Q8_0)
            raw[name] = (data, "Q8_0")
            values = gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q8_0)
            _, block, part, _ = name.split(".")
            exact[f"model.layers.{block}.{_MLX_NAMES[part]}"] = mx.array(values)
    path = tmp_path / "moe-q8.gguf"
    gm.write_with_gguf_package(path, "qwen3moe", tensors, raw, _meta(config))
    reference.load_weights([(f"{k}.weight", v) for k, v in exact.items()], strict=False)
    return path, reference, exact


_MLX_NAMES = {v: k for k, v in gm.NAMES.items()}


def test_q8_experts_stay_8_bit_exactly(tmp_path):
    path, reference, _ = _q8_experts(tmp_path)

    imported = import_in_child(path, tmp_path / "models", "moe-q8")

    model, _ = load_model(imported.path)
    switch = model.model.layers[0].mlp.switch_mlp.down_proj
    assert switch.bits == 8 and switch.weight.shape[0] == _EXPERTS
    got = np.array(model(_PROMPT).astype(mx.float32))
    expected = np.array(reference(_PROMPT))
    assert np.abs(got - expected).max() / np.abs(expected).max() < 1e-2


def test_experts_requantized_to_4_bits_are_mlx_s_own_quantization(tmp_path):
    """At 4 bits each expert row is quantized again in groups of 32, as mlx quantizes
    the file's values: the same codes for every expert (none dropped or swapped); the
    router stays at 8 bits."""
    path, _, exact = _q8_experts(tmp_path)

    imported = import_in_child(path, tmp_path / "models", "moe-q4", bits=4)

    model, _ = load_model(imported.path)
    assert model.model.layers[0].mlp.gate.bits == 8  # the router: mlx-lm's own choice
    for name, values in exact.items():
        block, part = name.removeprefix("model.layers.").split(".", 1)
        layer = model.model.layers[int(block)].mlp.switch_mlp
        switch = getattr(layer, part.rsplit(".", 1)[-1])
        assert (switch.bits, switch.group_size) == (4, 32)
        codes, scales, _ = mx.quantize(values, group_size=32, bits=4)
        assert bool(mx.array_equal(switch.weight, codes)), name
        np.testing.assert_allclose(np.array(switch.scales), np.array(scales), rtol=1e-3)


@pytest.mark.parametrize(
    ("meta", "edit", "message"),
    [
        ({"qwen3moe.expert_used_count": _u32(5)}, None, "uses 5 experts per token but has only 4"),
        ({"qwen3moe.expert_count": _u32(8)}, None, "not 8 experts of 64 rows"),
        ({"qwen3moe.expert_feed_forward_length": _u32(32)}, None, "not 4 experts of 32 rows"),
        ({}, lambda t: t.pop("blk.1.ffn_up_exps.weight"), "lacks layer 1's mlp.switch_mlp.up"),
        ({"qwen3moe.expert_used_count": _u32(0)}, None, "not a usable size"),
    ],
)
def test_inconsistent_expert_files_are_refused(tmp_path, meta, edit, message):
    config, _, tensors = _model()
    if edit:
        edit(tensors)
    path = tmp_path / "bad.gguf"
    mx.save_gguf(str(path), tensors, _meta(config, **meta))
    with pytest.raises(GGUFImportError, match=message):
        import_in_child(path, tmp_path / "models", "bad")
    assert not (tmp_path / "models").exists() or not list((tmp_path / "models").iterdir())
