"""Tiny random-weight models of every mlx-lm cache family, whose greedy replies are words.

Each builder writes a model folder mlx-lm loads like any downloaded one: a
config.json naming the `model_type`, weights made by mlx-lm's own model class
(`mlx_lm.models.<type>.Model(ModelArgs(...))` after `mx.random.seed`, saved
from `tree_flatten(model.parameters())`), and the starter model's tokenizer
files (its vocabulary of 49152 and its chat template). Hidden sizes are 64 so
that the embedding and output matrices stay small.

Words, not byte fragments: random weights pick any token, and most tokens are
pieces of words or bytes whose text does not survive a decode and re-encode,
which a real model's replies do. Here every output row of the model (its
`lm_head`, or the tied embedding where the class has no separate one) that
belongs to a non-word token is set to zero, so that token's logit is exactly
0 whatever the hidden state; the rows of word tokens stay random (and are
scaled up). A word token is one that decodes to a space followed by ASCII
letters and that the tokenizer encodes back to that one token. With thousands
of random word rows in a 64-dimensional space, some word's logit is positive
for every hidden state (all of them negative would need the state to lie in
the polar cone of thousands of random directions), so greedy decoding always
picks a word, and a reply " alpha beta gamma" re-encodes to its own tokens
(each word is a pre-tokenizer piece of its own). `greedy_words_round_trip`
checks that on each built model. Where the embedding is tied, the zeroed rows
are also the input embeddings of non-word tokens (the chat template's special
tokens then feed zeros): harmless for a test model.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from app.bench.shapes import word_tokens

VOCAB = 49152
HIDDEN = 64
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# Word rows are scaled up from mlx's small initial weights.
_WORD_SCALE = 4.0
# The hidden coordinate that says "after a newline" (+) or not (-), how strongly the
# embedding writes it, and how strongly the output rows read it.
_MARK = 0
_NEWLINE_MARK = 1.0
_CLASS_PULL = 20.0

_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}


@dataclass(frozen=True)
class Family:
    """One mlx-lm architecture at a tiny size, and the cache classes it makes."""

    name: str  # the test id
    model_type: str
    config: dict
    caches: tuple[str, ...]  # the cache class of each layer (`cache_classes`)
    chunkable: bool  # every layer a plain KVCache (chunk files) rather than a snapshot
    extras: dict = field(default_factory=dict)


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "llama",
            "llama",
            {
                "num_hidden_layers": 2,
                "intermediate_size": 128,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 32,
                "tie_word_embeddings": False,
            },
            ("KVCache", "KVCache"),
            True,
        ),
        Family(
            "sliding",
            "gemma3_text",
            {
                "num_hidden_layers": 3,
                "intermediate_size": 128,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 32,
                "query_pre_attn_scalar": 32,
                "sliding_window": 16,
                "sliding_window_pattern": 3,
                "rms_norm_eps": 1e-6,
            },
            ("RotatingKVCache", "RotatingKVCache", "KVCache"),
            False,
        ),
        Family(
            "hybrid-qwen3-next",
            "qwen3_next",
            {
                "num_hidden_layers": 4,
                "intermediate_size": 128,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 32,
                "linear_num_value_heads": 2,
                "linear_num_key_heads": 1,
                "linear_key_head_dim": 32,
                "linear_value_head_dim": 32,
                "linear_conv_kernel_dim": 4,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "decoder_sparse_step": 1,
                "shared_expert_intermediate_size": 64,
                "mlp_only_layers": [],
                "moe_intermediate_size": 64,
                "partial_rotary_factor": 0.5,
                "full_attention_interval": 2,
                "tie_word_embeddings": False,
            },
            ("ArraysCache", "KVCache", "ArraysCache", "KVCache"),
            False,
        ),
        Family(
            "hybrid-granite",
            "granitemoehybrid",
            {
                "num_hidden_layers": 3,
                "intermediate_size": 128,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "attention_bias": False,
                "embedding_multiplier": 1.0,
                "attention_multiplier": 1 / 32,
                "logits_scaling": 1.0,
                "residual_multiplier": 1.0,
                "layer_types": ["mamba", "attention", "mamba"],
                "mamba_n_heads": 8,  # transformers checks heads x head size = 2 x hidden
                "mamba_d_head": 16,
                "mamba_proj_bias": False,
                "mamba_d_state": 16,
                "mamba_d_conv": 4,
                "mamba_n_groups": 1,
                "mamba_conv_bias": True,
                "tie_word_embeddings": False,
            },
            ("ArraysCache", "KVCache", "ArraysCache"),
            False,
        ),
        Family(
            "moe",
            "qwen3_moe",
            {
                "num_hidden_layers": 2,
                "intermediate_size": 128,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 32,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
                "moe_intermediate_size": 64,
                "norm_topk_prob": True,
                "tie_word_embeddings": False,
            },
            ("KVCache", "KVCache"),
            True,
        ),
        Family(
            "mla",
            "deepseek_v3",
            {
                "num_hidden_layers": 2,
                "intermediate_size": 128,
                "moe_intermediate_size": 64,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "n_shared_experts": 1,
                "n_routed_experts": 4,
                "num_experts_per_tok": 2,
                "first_k_dense_replace": 1,
                "kv_lora_rank": 64,
                "q_lora_rank": 64,
                "qk_rope_head_dim": 32,
                "qk_nope_head_dim": 32,
                "v_head_dim": 32,
                "n_group": 1,
                "topk_group": 1,
            },
            ("KVCache", "KVCache"),  # keys 64 wide (the latent), values 32 (rope part),
            True,
        ),
        Family(
            "chunked",
            "llama4",
            {
                "text_config": {
                    "model_type": "llama4_text",
                    "attention_bias": False,
                    "attention_chunk_size": 16,
                    "head_dim": 32,
                    "hidden_size": HIDDEN,
                    "interleave_moe_layer_step": 2,
                    "intermediate_size": 64,
                    "intermediate_size_mlp": 128,
                    "max_position_embeddings": 4096,
                    "num_attention_heads": 2,
                    "num_experts_per_tok": 1,
                    "num_hidden_layers": 4,
                    "num_key_value_heads": 1,
                    "num_local_experts": 2,
                    "rms_norm_eps": 1e-5,
                    "rope_scaling": None,
                    "rope_theta": 10000.0,
                    "use_qk_norm": True,
                    "vocab_size": VOCAB,
                },
            },
            ("ChunkedKVCache", "ChunkedKVCache", "ChunkedKVCache", "KVCache"),
            False,
            {"no_common": True},
        ),
        Family(
            "cachelist",
            "falcon_h1",
            {
                "num_hidden_layers": 2,
                "intermediate_size": 128,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 32,
                "mamba_d_conv": 4,
                "mamba_d_head": 16,
                "mamba_d_ssm": 64,
                "mamba_d_state": 16,
                "mamba_n_groups": 1,
                "mamba_n_heads": 4,
                "mamba_chunk_size": 16,
                "tie_word_embeddings": False,
            },
            ("CacheList(ArraysCache,KVCache)",) * 2,
            False,
        ),
    )
}


def _config(family: Family) -> dict:
    base = {} if family.extras.get("no_common") else dict(_COMMON)
    return {**base, **family.config, "model_type": family.model_type}


def _embedding(model) -> nn.Embedding:
    return next(m for _, m in model.named_modules() if isinstance(m, nn.Embedding))


def _output_projection(model) -> nn.Linear:
    for owner in (model, getattr(model, "language_model", None)):
        if owner is not None and "lm_head" in owner:
            return owner.lm_head
    raise ValueError(f"{type(model).__module__} ties its output rows to its embedding")


def _words_only(model, spaced: tuple[int, ...], bare: tuple[int, ...], newline: int) -> None:
    """Only word tokens can win, a bare one right after a newline, spaced ones
    elsewhere (see the module docstring)."""
    head = _output_projection(model)
    rows = mx.zeros((head.weight.shape[0], 1), dtype=head.weight.dtype)
    rows[mx.array(spaced + bare)] = _WORD_SCALE
    weight = head.weight * rows
    weight[mx.array(bare), _MARK] = _CLASS_PULL
    weight[mx.array(spaced), _MARK] = -_CLASS_PULL
    head.weight = weight
    embedding = _embedding(model)
    table = embedding.weight
    table[:, _MARK] = -_NEWLINE_MARK
    table[newline, _MARK] = _NEWLINE_MARK
    embedding.weight = table


def build(family: Family | str, tokenizer_dir: Path, out_dir: Path, seed: int = 0) -> Path:
    """Write `family`'s model folder under `out_dir` (named after the family); return it."""
    from mlx_lm.utils import _get_classes

    family = FAMILIES[family] if isinstance(family, str) else family
    folder = Path(out_dir) / f"tiny-{family.name}"
    folder.mkdir(parents=True, exist_ok=True)
    config = _config(family)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    spaced, bare = word_tokens(Path(tokenizer_dir) / "tokenizer.json")
    _words_only(model, spaced, bare, _newline_id(Path(tokenizer_dir) / "tokenizer.json"))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, {"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copy(Path(tokenizer_dir) / name, folder / name)
    return folder


def _newline_id(tokenizer_json: Path) -> int:
    from tokenizers import Tokenizer

    (newline,) = Tokenizer.from_file(str(tokenizer_json)).encode("\n", add_special_tokens=False).ids
    return newline


# What the CPU path holds each of mlx-lm's attention classes as for 16 bits: float16
# (`SIXTEEN_BIT`), in the app's own classes.
FLOAT16_CLASSES = {
    "KVCache": "MixedKVCache",
    "RotatingKVCache": "MixedKVCache",
    "ChunkedKVCache": "ChunkedMixedKVCache",
}


def held_in_float16(caches: tuple[str, ...]) -> list[str]:
    """A family's `caches` as the CPU path holds them for 16 bits."""
    pattern = re.compile("|".join(sorted(FLOAT16_CLASSES, key=len, reverse=True)))
    return [pattern.sub(lambda m: FLOAT16_CLASSES[m.group()], name) for name in caches]


def cache_classes(cache: list) -> list[str]:
    """Each layer's cache class, a CacheList with its parts: "CacheList(ArraysCache,KVCache)"."""
    names = []
    for layer in cache:
        parts = getattr(layer, "caches", None)
        name = type(layer).__name__
        names.append(f"{name}({','.join(type(p).__name__ for p in parts)})" if parts else name)
    return names
