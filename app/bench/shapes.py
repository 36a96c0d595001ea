"""Real model shapes with random weights, for the benches: nothing to download.

Each shape is the config.json of a model people run, less what does not change
the arithmetic or the cache. `random_model` builds it with mlx-lm's own model
class, 4-bit like a typical download; `model_folder` also writes it as a model
folder (with the starter model's tokenizer files) that the engine loads like
any other, for `bench reopen --shape`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from app.engine.errors import UserError

SHAPES = {
    # Qwen3-1.7B: a plain attention model (KVCache), grouped-query heads.
    "qwen3-1.7b": {
        "model_type": "qwen3",
        "hidden_size": 2048,
        "num_hidden_layers": 28,
        "intermediate_size": 6144,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": True,
    },
    # Llama-3.1-8B.
    "llama-3.1-8b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
    },
    # Gemma-3-1B: sliding-window layers (RotatingKVCache, a 512-token window) with
    # one global layer in six.
    "gemma3-1b": {
        "model_type": "gemma3_text",
        "hidden_size": 1152,
        "num_hidden_layers": 26,
        "intermediate_size": 6912,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "vocab_size": 262144,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "max_position_embeddings": 32768,
    },
    # A Qwen3-Next-style hybrid: three linear-attention layers (ArraysCache: conv and
    # recurrent state) to one full-attention layer, Qwen3-Next-80B's widths, with 24
    # layers and 16 experts instead of 48 and 512 so that it fits a laptop.
    "qwen3-next-hybrid": {
        "model_type": "qwen3_next",
        "hidden_size": 2048,
        "num_hidden_layers": 24,
        "intermediate_size": 5120,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_value_heads": 32,
        "linear_num_key_heads": 16,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 512,
        "mlp_only_layers": [],
        "moe_intermediate_size": 512,
        "partial_rotary_factor": 0.25,
        "full_attention_interval": 4,
        "norm_topk_prob": True,
        "vocab_size": 151936,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000000.0,
        "max_position_embeddings": 262144,
        "tie_word_embeddings": False,
    },
    # For a smoke run.
    "tiny": {
        "model_type": "qwen3",
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 49152,  # the starter model's tokenizer
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": True,
    },
}

GROUP_SIZE, BITS = 64, 4
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def config_of(shape: str) -> dict:
    if shape not in SHAPES:
        raise UserError(f"Unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    return dict(SHAPES[shape])


def random_model(shape: str, dtype: mx.Dtype = mx.bfloat16, seed: int = 0) -> nn.Module:
    """The shape's architecture with random weights, 4-bit like a typical download."""
    from mlx_lm.utils import _get_classes

    config = config_of(shape)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(dtype)
    nn.quantize(model, group_size=GROUP_SIZE, bits=BITS)
    mx.eval(model.parameters())
    return model


def model_folder(shape: str, tokenizer_dir: Path, out_dir: Path) -> Path:
    """Write the shape as a model folder under `out_dir`, with `tokenizer_dir`'s
    tokenizer (its ids are below every shape's vocabulary size); return the folder."""
    folder = Path(out_dir) / f"random-{shape}"
    folder.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(random_model(shape).parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, {"format": "mlx"})
    config = {**config_of(shape), "quantization": {"group_size": GROUP_SIZE, "bits": BITS}}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copy(Path(tokenizer_dir) / name, folder / name)
    return folder
