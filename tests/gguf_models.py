"""Tiny random-weight models written as GGUF files the way llama.cpp's converter writes them.

The reference is an mlx-lm model built from its own class; `gguf_tensors` gives its
weights under llama.cpp's tensor names with the converter's transforms (llama's Q
and K permuted into the interleaved rope layout; Gemma's norm weights plus one),
`metadata` the `<arch>.*` keys.
"""

from __future__ import annotations

import importlib

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

import tiny

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 96
HEAD_DIM = 32  # qwen3 and gemma: a head size other than hidden / heads
# GGUF architecture -> mlx-lm module, where they differ
MODEL_TYPES = {"gemma3": "gemma3_text", "qwen3moe": "qwen3_moe"}

NAMES = {
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
    "mlp.gate": "ffn_gate_inp",  # a mixture of experts' router, and its stacked experts
    "mlp.switch_mlp.gate_proj": "ffn_gate_exps",
    "mlp.switch_mlp.up_proj": "ffn_up_exps",
    "mlp.switch_mlp.down_proj": "ffn_down_exps",
}


_GEMMA_NAMES = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
ARCH_NAMES = {
    "gemma2": _GEMMA_NAMES,
    "gemma3": _GEMMA_NAMES,
    "phi3": {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
}


def config(arch: str, tied: bool, **extra) -> dict:
    """mlx-lm's config for a tiny model of GGUF architecture `arch`."""
    model_type = MODEL_TYPES.get(arch, arch)
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
    if arch in ("qwen3", "qwen3moe", "gemma2", "gemma3"):
        config["head_dim"] = HEAD_DIM
    if arch.startswith("gemma"):  # llama.cpp's query scale for all but the 27B models
        config["query_pre_attn_scalar"] = HEAD_DIM
    return config | extra


def reference(config: dict):
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


def gguf_tensors(model, arch: str) -> dict[str, mx.array]:
    names = NAMES | ARCH_NAMES.get(arch, {})
    tensors = {}
    for name, value in tree_flatten(model.parameters()):
        stem, suffix = name.rsplit(".", 1)
        if stem == "lm_head" and getattr(model.args, "tie_word_embeddings", False):
            continue  # gemma3_text has the parameter even when it is tied
        if stem.startswith("model.layers."):
            _, _, block, part = stem.split(".", 3)
            gguf = f"blk.{block}.{names[part]}"
            if arch == "llama" and part in ("self_attn.q_proj", "self_attn.k_proj"):
                value = _interleave(value, HEADS if "q_proj" in part else KV_HEADS)
        else:
            gguf = names[stem]
        if arch.startswith("gemma") and stem.endswith("norm"):
            value = value + 1  # Gemma's norms scale by 1 + weight; llama.cpp stores the sum
        tensors[f"{gguf}.{suffix}"] = value.astype(mx.float32)
    return tensors


def metadata(arch: str, config: dict, **overrides) -> dict:
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


def write_with_gguf_package(path, arch: str, tensors: dict, raw: dict, meta: dict) -> None:
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
