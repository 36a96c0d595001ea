"""GGUF architectures we import: tensor names and metadata mapped to mlx-lm's layout.

One `Architecture` per GGUF `general.architecture` we accept. What differs
between them, and why it matters:

- Q/K layout. llama.cpp's converter permutes the Q and K projections of llama
  models (its `LlamaModel.modify_tensors`) into the interleaved rotary layout,
  which is MLX's "traditional" rope, so a llama import sets
  `rope_traditional: true` and leaves the weights as they are. Its Qwen2 and
  Qwen3 converters write Q and K unpermuted (Hugging Face's rotate-half layout),
  so those imports keep mlx-lm's default `rope_traditional: false`.
- Extra tensors: Qwen2 has biases on the Q, K and V projections; Qwen3 has
  RMS norms on each head's queries and keys (`attn_q_norm`, `attn_k_norm`).
- Gemma 2 and 3 norm after attention and around the MLP too, and their RMS norms
  scale by `1 + weight`; llama.cpp's converter adds the one to every norm weight
  (its `Gemma2Model` / `Gemma3Model.modify_tensors`) and mlx-lm adds it at run
  time, so the import takes it off again. Their settings llama.cpp does not
  store (the query scale, Gemma 3's local rope base and layer pattern) are set as
  llama.cpp's own loader sets them.
- Phi-3 keeps Q, K, V in one fused matrix (`attn_qkv`) and gate and up in another
  (`ffn_up`), as mlx-lm's phi3 does: names change, weights do not.
- Qwen3-MoE is Qwen3 with a mixture of experts for every layer's MLP: a router
  (`ffn_gate_inp`) and each projection of all experts stacked in one 3-D tensor
  (`ffn_gate_exps` ...), experts x rows x columns once GGUF's reversed dimensions
  are put back, which is the layout of mlx-lm's `SwitchGLU`. llama.cpp's graph
  always renormalizes the chosen experts' weights (`norm_topk_prob`), so we do.
- Metadata keys are prefixed with the architecture name (`qwen2.block_count`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from app.engine.gguf_check import GGUFImportError

_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_PER_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GEMMA_BLOCK = {k: v for k, v in _PER_BLOCK.items() if k != "ffn_norm"} | {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
}
_MOE_BLOCK = {k: v for k, v in _PER_BLOCK.items() if not k.startswith("ffn_")} | {
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
}
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|scales|biases|bias)$")
_TOP_NAME = re.compile(r"^([a-z_]+)\.(weight|scales|biases|bias)$")


@dataclass(frozen=True)
class Architecture:
    gguf_name: str
    model_type: str  # mlx-lm's module name
    hf_class: str
    rope_traditional: bool
    per_block: dict[str, str]  # GGUF block tensor -> mlx-lm name, all required
    biased: tuple[str, ...] = ()  # GGUF block tensors that also carry a required .bias
    rope_theta: float = 10000.0
    norm_shift: float = 0.0  # what llama.cpp's converter added to every norm weight
    tied_only: bool = False  # mlx-lm's model has no separate output matrix
    # config entries of this family's own, from the metadata and the base config
    extra_config: Callable[[dict, str, dict], dict] | None = None


def _gemma2_config(meta: dict, prefix: str, config: dict) -> dict:
    return {
        "attn_logit_softcapping": float(meta_num(meta, f"{prefix}.attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": float(meta_num(meta, f"{prefix}.final_logit_softcapping", 30.0)),
        "query_pre_attn_scalar": _gemma_query_scalar(config, 46),
    }


def _gemma3_config(meta: dict, prefix: str, config: dict) -> dict:
    extra = {
        "query_pre_attn_scalar": _gemma_query_scalar(config, 62),
        # llama.cpp's loader: rope base 10000 on the sliding layers, every sixth global
        "rope_local_base_freq": float(meta_num(meta, f"{prefix}.rope.freq_base_swa", 10000.0)),
        "sliding_window_pattern": meta_count(meta, f"{prefix}.attention.sliding_window_pattern", 6),
    }
    if f"{prefix}.attention.sliding_window" in meta:
        extra["sliding_window"] = meta_count(meta, f"{prefix}.attention.sliding_window")
    else:  # no window: every layer global
        extra["sliding_window_pattern"] = 1
    if extra["sliding_window_pattern"] > config["num_hidden_layers"]:
        # mlx-lm's gemma3_text reads the first global layer's cache: there must be one.
        raise GGUFImportError(
            f"This gemma3 model's sliding window pattern ({extra['sliding_window_pattern']}) "
            f"is longer than its {config['num_hidden_layers']} layers"
        )
    scaling = meta_str(meta, f"{prefix}.rope.scaling.type")
    if scaling == "linear":
        factor = float(meta_num(meta, f"{prefix}.rope.scaling.factor"))
        if factor <= 0:
            raise GGUFImportError(f"The GGUF rope scaling factor ({factor}) is not usable")
        extra["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    elif scaling not in (None, "none"):
        raise GGUFImportError(f"Gemma 3 rope scaling {scaling!r} is not supported yet")
    return extra


def _gemma_query_scalar(config: dict, layers_of_27b: int) -> int | float:
    """llama.cpp scales Gemma's queries by the head size, except in the 27B models
    (which it knows by their layer count), whose scale is hidden size / heads. A whole
    number is written as one: transformers' Gemma config refuses a float there."""
    if config["num_hidden_layers"] != layers_of_27b:
        return config["head_dim"]
    scalar = config["hidden_size"] / config["num_attention_heads"]
    return int(scalar) if scalar == int(scalar) else scalar


def _phi3_config(meta: dict, prefix: str, config: dict) -> dict:
    head_dim = config["head_dim"]
    if head_dim * config["num_attention_heads"] != config["hidden_size"]:
        # mlx-lm's phi3 derives the head size from the hidden size.
        raise GGUFImportError(f"This phi3 model's head size ({head_dim}) is not supported")
    rotary = meta_count(meta, f"{prefix}.rope.dimension_count", head_dim)
    if rotary > head_dim:
        raise GGUFImportError(f"The GGUF rope dimension count ({rotary}) exceeds the head size")
    return {"partial_rotary_factor": rotary / head_dim}


def _qwen3moe_config(meta: dict, prefix: str, config: dict) -> dict:
    experts = meta_count(meta, f"{prefix}.expert_count")
    used = meta_count(meta, f"{prefix}.expert_used_count")
    if used > experts:
        raise GGUFImportError(
            f"This qwen3moe model uses {used} experts per token but has only {experts}"
        )
    return {
        "num_experts": experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": meta_count(meta, f"{prefix}.expert_feed_forward_length"),
        "decoder_sparse_step": 1,  # llama.cpp's qwen3moe: every layer a mixture
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    }


def check_experts(weights: dict[str, mx.array], config: dict) -> None:
    """Each stacked expert tensor must hold the experts the metadata counts, at its
    sizes; a mismatch would otherwise fail only when the model is opened."""
    if "num_experts" not in config:
        return
    hidden, ffn = config["hidden_size"], config["moe_intermediate_size"]
    experts = config["num_experts"]
    for key, value in weights.items():
        if key.endswith(".mlp.gate.weight") and value.shape[0] != experts:
            raise GGUFImportError(
                f"{key} routes to {value.shape[0]} experts; the metadata says {experts}"
            )
        if ".switch_mlp." in key and key.endswith(".weight"):
            rows = hidden if "down_proj" in key else ffn
            if value.ndim != 3 or value.shape[:2] != (experts, rows):
                raise GGUFImportError(
                    f"{key} has shape {list(value.shape)}, not {experts} experts of {rows} rows"
                )


ARCHITECTURES = {
    arch.gguf_name: arch
    for arch in (
        Architecture("llama", "llama", "LlamaForCausalLM", True, _PER_BLOCK),
        Architecture(
            "qwen2",
            "qwen2",
            "Qwen2ForCausalLM",
            False,
            _PER_BLOCK,
            biased=("attn_q", "attn_k", "attn_v"),
            rope_theta=1000000.0,
        ),
        Architecture(
            "qwen3",
            "qwen3",
            "Qwen3ForCausalLM",
            False,
            _PER_BLOCK | _QK_NORMS,
            rope_theta=1000000.0,
        ),
        Architecture(
            "qwen3moe",
            "qwen3_moe",
            "Qwen3MoeForCausalLM",
            False,
            _MOE_BLOCK | _QK_NORMS,
            rope_theta=1000000.0,
            extra_config=_qwen3moe_config,
        ),
        Architecture(
            "gemma2",
            "gemma2",
            "Gemma2ForCausalLM",
            False,
            _GEMMA_BLOCK,
            norm_shift=1.0,
            tied_only=True,
            extra_config=_gemma2_config,
        ),
        Architecture(
            "gemma3",
            "gemma3_text",
            "Gemma3ForCausalLM",
            False,
            _GEMMA_BLOCK | _QK_NORMS,
            rope_theta=1000000.0,
            norm_shift=1.0,
            extra_config=_gemma3_config,
        ),
        Architecture(
            "phi3", "phi3", "Phi3ForCausalLM", False, _PHI3_BLOCK, extra_config=_phi3_config
        ),
    )
}


def architecture_of(meta: dict, file_name: str) -> Architecture:
    name = meta_str(meta, "general.architecture")
    if name not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise GGUFImportError(
            f"{file_name} is a {name or 'unknown'!r} model; "
            f"only these GGUF architectures can be imported: {supported}"
        )
    return ARCHITECTURES[name]


def meta_str(meta: dict, key: str) -> str | None:
    value = meta.get(key)
    return value if isinstance(value, str) else None


def meta_num(meta: dict, key: str, default=None):
    value = meta.get(key)
    if value is None:
        if default is None:
            raise GGUFImportError(f"The GGUF metadata lacks {key}")
        return default
    if isinstance(value, mx.array) and value.size == 1:
        value = value.item()
    if isinstance(value, bool | int | float) and math.isfinite(value):
        return value
    raise GGUFImportError(f"The GGUF metadata {key} is not a number")


def meta_count(meta: dict, key: str, default: int | None = None) -> int:
    """A size the model is built with: a whole number of at least 1."""
    value = meta_num(meta, key, default)
    if isinstance(value, bool) or value != int(value) or value < 1:
        raise GGUFImportError(f"The GGUF metadata {key} ({value}) is not a usable size")
    return int(value)


def map_weights(arch: Architecture, tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    """GGUF tensor names -> mlx-lm parameter names; any tensor we do not know is refused."""
    weights = {}
    for key, value in tensors.items():
        if match := _BLOCK_NAME.match(key):
            block, part, suffix = match.groups()
            if part not in arch.per_block or (suffix == "bias" and part not in arch.biased):
                raise GGUFImportError(
                    f"Unsupported tensor {key} (not a plain {arch.gguf_name} block)"
                )
            name = f"model.layers.{block}.{arch.per_block[part]}.{suffix}"
            weights[name] = _unshift(arch, part, value)
        elif (match := _TOP_NAME.match(key)) and match.group(1) in _TOP_LEVEL:
            if arch.tied_only and match.group(1) == "output":
                raise GGUFImportError(f"A {arch.gguf_name} model has no separate {key}")
            weights[f"{_TOP_LEVEL[match.group(1)]}.{match.group(2)}"] = _unshift(
                arch, match.group(1), value
            )
        elif key in ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"):
            raise GGUFImportError(
                "GGUF files with rope frequency factors (long-context rope scaling) "
                "are not supported yet"
            )
        else:
            raise GGUFImportError(f"Unsupported tensor {key} (not a plain {arch.gguf_name} model)")
    return weights


def _unshift(arch: Architecture, part: str, value: mx.array) -> mx.array:
    """A norm weight as mlx-lm's model expects it: llama.cpp's offset taken off again."""
    if arch.norm_shift and part.endswith("norm"):
        return (value.astype(mx.float32) - arch.norm_shift).astype(value.dtype)
    return value


def _check_complete(arch: Architecture, weights: dict[str, mx.array], layers: int) -> None:
    for i in range(layers):
        for gguf_part, part in arch.per_block.items():
            suffixes = ("weight", "bias") if gguf_part in arch.biased else ("weight",)
            for suffix in suffixes:
                if f"model.layers.{i}.{part}.{suffix}" not in weights:
                    raise GGUFImportError(f"The GGUF file lacks layer {i}'s {part} {suffix}")
    if "model.embed_tokens.weight" not in weights:
        raise GGUFImportError("The GGUF file lacks the token embeddings")


def model_config(arch: Architecture, meta: dict, weights: dict[str, mx.array]) -> dict:
    """mlx-lm's config.json for the mapped weights."""
    prefix = arch.gguf_name

    def count(key: str, default: int | None = None) -> int:
        return meta_count(meta, f"{prefix}.{key}", default)

    hidden = count("embedding_length")
    layers = count("block_count")
    heads = count("attention.head_count")
    head_dim = count("attention.key_length", max(1, hidden // heads))
    _check_complete(arch, weights, layers)
    eps = meta_num(meta, f"{prefix}.attention.layer_norm_rms_epsilon")
    config = {
        "model_type": arch.model_type,
        "architectures": [arch.hf_class],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": count("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": count("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(eps),
        "vocab_size": weights["model.embed_tokens.weight"].shape[0],
        "rope_theta": float(meta_num(meta, f"{prefix}.rope.freq_base", arch.rope_theta)),
        "rope_traditional": arch.rope_traditional,
        "max_position_embeddings": count("context_length", 4096),
        "tie_word_embeddings": "lm_head.weight" not in weights,
    }
    if arch.model_type == "qwen2" and head_dim * heads != hidden:
        # mlx-lm's qwen2 derives the head size from the hidden size; it has no head_dim.
        raise GGUFImportError(f"This qwen2 model's head size ({head_dim}) is not supported")
    if arch.extra_config:
        config |= arch.extra_config(meta, prefix, config)
    check_experts(weights, config)
    ffn = config.get("moe_intermediate_size", config["intermediate_size"])
    quantization = _quantization(weights, hidden, heads * head_dim, ffn)
    if quantization:
        config["quantization"] = quantization
    return config


def _quantization(weights: dict[str, mx.array], hidden: int, attn: int, ffn: int) -> dict:
    """mlx-lm's quantization entry: the commonest setting, plus per-layer exceptions."""
    in_dims = {"embed_tokens": hidden, "o_proj": attn, "down_proj": ffn}
    quantized = {}
    for key, scales in weights.items():
        if key.endswith(".scales"):
            prefix = key[: -len(".scales")]
            dims = in_dims.get(prefix.rsplit(".", 1)[-1], hidden)
            packed = weights[f"{prefix}.weight"]
            quantized[prefix] = {
                "group_size": dims // scales.shape[-1],
                "bits": packed.shape[-1] * 32 // dims,
            }
    if not quantized:
        return {}
    settings = [json.dumps(q, sort_keys=True) for q in quantized.values()]
    default = json.loads(max(set(settings), key=settings.count))
    result = dict(default)
    for prefix, params in quantized.items():
        if params != default:
            result[prefix] = params
    return result
