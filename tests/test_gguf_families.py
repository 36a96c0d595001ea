"""GGUF files of each architecture we import give the model they were made from.

Each test builds a small mlx-lm model with random weights (the reference), writes
its weights as llama.cpp's converter lays them out in a GGUF file (its tensor
names and metadata keys; for llama, Q and K permuted into the interleaved rope
layout, which llama.cpp does for llama and not for Qwen), imports the file through
the import child as the app does, loads the folder with mlx-lm and compares the
logits with the reference's. A wrong name mapping, a missing permutation or the
wrong rope setting changes the logits.
"""

from __future__ import annotations

import importlib
import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model

import tiny
from app.engine.gguf_child import import_in_child
from app.engine.gguf_import import GGUFImportError

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 96
HEAD_DIM = 32  # qwen3 only: a head size other than hidden / heads

_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _config(model_type: str, tied: bool) -> dict:
    config = {
        "model_type": model_type,
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "intermediate_size": FFN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "rms_norm_eps": 1e-6,
        "vocab_size": len(tiny.vocabulary()),
        "rope_theta": 50000.0,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": tied,
    }
    if model_type == "qwen3":
        config["head_dim"] = HEAD_DIM
    return config


def _reference(config: dict):
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(7)
    model = module.Model(module.ModelArgs.from_dict(config))
    # Norm weights start at one; random ones make a mis-mapped norm visible.
    params = {
        k: mx.random.normal(v.shape) * 0.3 + (1.0 if "norm" in k else 0.0)
        for k, v in tree_flatten(model.parameters())
    }
    model.load_weights(list(params.items()))
    mx.eval(model.parameters())
    return model


def _interleave(w: mx.array, heads: int) -> mx.array:
    """llama.cpp's permutation of a llama Q or K projection (rotate-half -> interleaved)."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensors(model, arch: str) -> dict[str, mx.array]:
    tensors = {}
    for name, value in tree_flatten(model.parameters()):
        stem, suffix = name.rsplit(".", 1)
        if stem.startswith("model.layers."):
            _, _, block, part = stem.split(".", 3)
            gguf = f"blk.{block}.{_NAMES[part]}"
            if arch == "llama" and part in ("self_attn.q_proj", "self_attn.k_proj"):
                value = _interleave(value, HEADS if "q_proj" in part else KV_HEADS)
        else:
            gguf = _NAMES[stem]
        tensors[f"{gguf}.{suffix}"] = value.astype(mx.float32)
    return tensors


def _metadata(arch: str, config: dict, **overrides) -> dict:
    def u32(value: int) -> mx.array:
        return mx.array(value, dtype=mx.uint32)

    meta = {k: v for k, v in tiny.metadata().items() if not k.startswith("llama.")}
    meta |= {
        "general.architecture": arch,
        f"{arch}.embedding_length": u32(HIDDEN),
        f"{arch}.block_count": u32(LAYERS),
        f"{arch}.feed_forward_length": u32(FFN),
        f"{arch}.attention.head_count": u32(HEADS),
        f"{arch}.attention.head_count_kv": u32(KV_HEADS),
        f"{arch}.attention.layer_norm_rms_epsilon": mx.array(1e-6, dtype=mx.float32),
        f"{arch}.rope.freq_base": mx.array(config["rope_theta"], dtype=mx.float32),
        f"{arch}.context_length": u32(1024),
        "tokenizer.ggml.pre": "qwen2" if arch.startswith("qwen") else "smollm",
    }
    if "head_dim" in config:
        meta[f"{arch}.attention.key_length"] = u32(config["head_dim"])
        meta[f"{arch}.attention.value_length"] = u32(config["head_dim"])
    return meta | overrides


@pytest.mark.parametrize(
    ("arch", "tied"), [("llama", False), ("qwen2", True), ("qwen2", False), ("qwen3", True)]
)
def test_imported_model_gives_the_reference_logits(tmp_path, arch, tied):
    config = _config(arch, tied)
    reference = _reference(config)
    gguf = tmp_path / f"{arch}.gguf"
    tensors = _gguf_tensors(reference, arch)
    assert ("output.weight" in tensors) is not tied
    mx.save_gguf(str(gguf), tensors, _metadata(arch, config))

    imported = import_in_child(gguf, tmp_path / "models", arch)

    assert imported.architecture == arch
    written = json.loads((imported.path / "config.json").read_text())
    assert written["model_type"] == arch
    assert written["rope_traditional"] is (arch == "llama")
    assert written["rope_theta"] == 50000.0 and written["tie_word_embeddings"] is tied
    model, _ = load_model(imported.path)
    prompt = mx.array([[5, 70, 99, 3, 180, 260, 42, 11]])
    expected, got = reference(prompt), model(prompt)
    np.testing.assert_allclose(np.array(got), np.array(expected), atol=1e-4, rtol=1e-4)


def test_qwen_pre_tokenizer_splits_numbers_into_digits(tmp_path):
    config = _config("qwen2", True)
    gguf = tmp_path / "q.gguf"
    mx.save_gguf(str(gguf), _gguf_tensors(_reference(config), "qwen2"), _metadata("qwen2", config))
    imported = import_in_child(gguf, tmp_path / "models", "q")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(imported.path / "tokenizer.json"))
    pieces = [tokenizer.decode([i]) for i in tokenizer.encode("in 2024 the").ids]
    assert pieces[pieces.index("2") : pieces.index("2") + 4] == ["2", "0", "2", "4"]
    assert " the" in pieces


def test_a_qwen2_file_without_its_attention_biases_is_refused(tmp_path):
    config = _config("qwen2", True)
    tensors = _gguf_tensors(_reference(config), "qwen2")
    del tensors["blk.1.attn_k.bias"]
    gguf = tmp_path / "nobias.gguf"
    mx.save_gguf(str(gguf), tensors, _metadata("qwen2", config))
    with pytest.raises(GGUFImportError, match=r"layer 1's self_attn\.k_proj bias"):
        import_in_child(gguf, tmp_path / "models", "nobias")
    assert not (tmp_path / "models").exists() or not list((tmp_path / "models").iterdir())


def test_an_unknown_architecture_names_the_ones_supported(tmp_path):
    config = _config("qwen2", True)
    gguf = tmp_path / "gemma.gguf"
    tensors = _gguf_tensors(_reference(config), "qwen2")
    mx.save_gguf(
        str(gguf), tensors, _metadata("qwen2", config, **{"general.architecture": "gemma2"})
    )
    with pytest.raises(GGUFImportError, match=r"'gemma2' model; only .*llama, qwen2, qwen3"):
        import_in_child(gguf, tmp_path / "models", "gemma")
