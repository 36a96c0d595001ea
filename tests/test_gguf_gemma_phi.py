"""Gemma 2, Gemma 3 and Phi-3 GGUF files give the model they were made from.

As in test_gguf_families: a tiny mlx-lm model with random weights is the
reference; its weights go into a GGUF file as llama.cpp's converter writes them
(Gemma's norm weights plus one, Phi-3's fused QKV and gate-up matrices under
`attn_qkv` / `ffn_up`), with the metadata keys the converter writes; the import's
logits must be the reference's. A missing norm offset, a wrong softcap, query
scale, sliding window or partial rotary size changes them.
"""

from __future__ import annotations

import json

import gguf_models as gm
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model

from app.engine.gguf_child import import_in_child
from app.engine.gguf_import import GGUFImportError
from app.engine.loading import load

_PROMPT = mx.array([[5, 70, 99, 3, 180, 260, 42, 11, 8, 17]])  # longer than the window


def _f32(value: float) -> mx.array:
    return mx.array(value, dtype=mx.float32)


def _u32(value: int) -> mx.array:
    return mx.array(value, dtype=mx.uint32)


_CASES = {
    "gemma2": (
        {"attn_logit_softcapping": 20.0, "final_logit_softcapping": 15.0},
        {
            "gemma2.attn_logit_softcapping": _f32(20.0),
            "gemma2.final_logit_softcapping": _f32(15.0),
            "gemma2.attention.sliding_window": _u32(4096),
        },
    ),
    # No pattern in the file (llama.cpp's converter writes none): every sixth layer is
    # global, the others slide over 4 tokens; linear rope scaling on the global ones.
    "gemma3": (
        {
            "num_hidden_layers": 6,
            "sliding_window": 4,
            "sliding_window_pattern": 6,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        },
        {
            "gemma3.block_count": _u32(6),
            "gemma3.attention.sliding_window": _u32(4),
            "gemma3.rope.scaling.type": "linear",
            "gemma3.rope.scaling.factor": _f32(8.0),
        },
    ),
    "phi3": ({"partial_rotary_factor": 0.5}, {"phi3.rope.dimension_count": _u32(8)}),
}


def _write(tmp_path, arch: str, tensor_edit=None, **meta_overrides):
    extra, meta = _CASES[arch]
    config = gm.config(arch, arch == "gemma2", **extra)
    reference = gm.reference(config)
    tensors = gm.gguf_tensors(reference, arch)
    if tensor_edit:
        tensor_edit(tensors)
    path = tmp_path / f"{arch}.gguf"
    mx.save_gguf(str(path), tensors, gm.metadata(arch, config, **meta | meta_overrides))
    return path, reference, config


@pytest.mark.parametrize("arch", list(_CASES))
def test_imported_model_gives_the_reference_logits(tmp_path, arch):
    path, reference, config = _write(tmp_path, arch)

    imported = import_in_child(path, tmp_path / "models", arch)

    written = json.loads((imported.path / "config.json").read_text())
    assert written["model_type"] == config["model_type"]
    for key, value in _CASES[arch][0].items():
        assert written[key] == value, key
    model, _ = load_model(imported.path)
    expected, got = reference(_PROMPT), model(_PROMPT)
    np.testing.assert_allclose(np.array(got), np.array(expected), atol=1e-4, rtol=1e-4)
    # The app opens it too (its loader also reads the config with transformers).
    loaded = load(imported.path)
    assert (
        loaded.tokenizer.decode(loaded.tokenizer.encode("the theme", add_special_tokens=False))
        == "the theme"
    )


def test_the_norm_offset_matters(tmp_path):
    """Without taking llama.cpp's +1 off the norms the logits are far off (so the
    test above would see a missing offset)."""
    path, reference, _ = _write(tmp_path, "gemma2")
    imported = import_in_child(path, tmp_path / "models", "g")
    model, _ = load_model(imported.path)
    weights = dict(model.parameters()["model"]["layers"][0].items())
    norm = weights["input_layernorm"]["weight"]
    model.model.layers[0].input_layernorm.weight = norm + 1
    expected, got = reference(_PROMPT), model(_PROMPT)
    assert float(mx.abs(got - expected).max()) > 1e-2


@pytest.mark.parametrize(
    ("arch", "edit", "meta", "message"),
    [
        (
            "phi3",
            lambda t: t.update({"rope_factors_long.weight": mx.ones((4,))}),
            {},
            "rope frequency factors",
        ),
        (
            "gemma2",
            lambda t: t.update({"output.weight": t["token_embd.weight"]}),
            {},
            "no separate output.weight",
        ),
        ("gemma3", None, {"gemma3.rope.scaling.type": "yarn"}, "rope scaling 'yarn'"),
        ("phi3", None, {"phi3.rope.dimension_count": _u32(64)}, "exceeds the head size"),
        ("gemma3", None, {"gemma3.attention.sliding_window": _f32(-3.0)}, "not a usable size"),
        (
            "gemma3",
            None,
            {"gemma3.attention.sliding_window_pattern": _u32(7)},
            "longer than its 6 layers",
        ),
    ],
)
def test_files_these_families_cannot_run_are_refused(tmp_path, arch, edit, meta, message):
    path, _, _ = _write(tmp_path, arch, edit, **meta)
    with pytest.raises(GGUFImportError, match=message):
        import_in_child(path, tmp_path / "models", "bad")
    assert not (tmp_path / "models").exists() or not list((tmp_path / "models").iterdir())
