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


# K-quant blocks: random bytes are valid blocks; only the float16 super-block scales
# (at these byte offsets) are fixed, small, so that the weights stay in a sane range.
_KQUANT_SCALES = {
    "Q2_K": (80, b"\x00\x1c\x00\x1c"),  # d, dmin = 2^-8
    "Q4_K": (0, b"\x00\x0c\x00\x0c"),  # d, dmin = 2^-12
    "Q6_K": (208, b"\x00\x04"),  # d = 2^-14
}


def _quantized(values: np.ndarray, type_name: str, rng) -> np.ndarray:
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name not in _KQUANT_SCALES:
        return gguf.quants.quantize(values, qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(values.size // block, size), dtype=np.uint8)
    start, scales = _KQUANT_SCALES[type_name]
    raw[:, start : start + len(scales)] = np.frombuffer(scales, dtype=np.uint8)
    return raw.reshape(values.shape[0], -1)


def _write_with_gguf_package(path, arch: str, tensors: dict, raw: dict, meta: dict) -> None:
    """A GGUF file written by the `gguf` package, which can store K-quant tensors."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        if key == "general.architecture":
            continue
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        elif value.ndim:
            writer.add_array(key, value.tolist())
        elif value.dtype == mx.float32:
            writer.add_float32(key, value.item())
        else:
            writer.add_uint32(key, value.item())
    for name, value in tensors.items():
        if name in raw:
            data, type_name = raw[name]
            writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[type_name])
        else:
            writer.add_tensor(name, np.array(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("type_name", ["Q2_K", "Q4_K", "Q6_K", "BF16"])
def test_k_quant_and_bf16_tensors_import_as_float16_with_their_values(tmp_path, type_name):
    import gguf

    config = _config("llama", False) | {"intermediate_size": 256}
    reference = _reference(config)
    tensors = _gguf_tensors(reference, "llama")
    rng = np.random.default_rng(0)
    raw, exact = {}, []
    for i in range(LAYERS):
        name = f"blk.{i}.ffn_down.weight"  # rows of 256: whole K-quant blocks
        data = _quantized(np.array(tensors[name]), type_name, rng)
        raw[name] = (data, type_name)
        qtype = gguf.GGMLQuantizationType[type_name]
        values = gguf.quants.dequantize(data, qtype).astype(np.float16).astype(np.float32)
        exact.append((f"model.layers.{i}.mlp.down_proj.weight", mx.array(values)))
    reference.load_weights(exact, strict=False)  # the reference gets the exact values
    gguf_path = tmp_path / "k.gguf"
    meta = _metadata(
        "llama", config, **{"llama.feed_forward_length": mx.array(256, dtype=mx.uint32)}
    )
    _write_with_gguf_package(gguf_path, "llama", tensors, raw, meta)

    imported = import_in_child(gguf_path, tmp_path / "models", "k")

    assert f"float16 (dequantized from {type_name})" in imported.weights
    model, _ = load_model(imported.path)
    prompt = mx.array([[5, 70, 99, 3, 180, 260, 42, 11]])
    expected, got = reference(prompt), model(prompt)
    np.testing.assert_allclose(np.array(got), np.array(expected), atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("type_name", ["Q5_K", "Q3_K", "IQ4_NL"])
def test_unsupported_tensor_types_are_refused_by_name(tmp_path, type_name):
    config = _config("llama", False) | {"intermediate_size": 256}
    tensors = _gguf_tensors(_reference(config), "llama")
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = np.zeros((HIDDEN, 256 // block * size), dtype=np.uint8)
    gguf_path = tmp_path / "odd.gguf"
    meta = _metadata("llama", config)
    _write_with_gguf_package(
        gguf_path, "llama", tensors, {"blk.0.ffn_down.weight": (data, type_name)}, meta
    )
    with pytest.raises(GGUFImportError, match=f"blk.0.ffn_down.weight as {type_name}, which"):
        import_in_child(gguf_path, tmp_path / "models", "odd")
    assert not (tmp_path / "models").exists() or not list((tmp_path / "models").iterdir())
