"""Real model shapes with random weights, for the benches: nothing to download.

Each shape is the config.json of a model people run, less what does not change
the arithmetic or the cache. `random_model` builds it with mlx-lm's own model
class, 4-bit like a typical download; `model_folder` also writes it as a model
folder (with the starter model's tokenizer files) that the engine loads like
any other, for `bench reopen --shape`, whose greedy replies are then words (see
`word_tokens`).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from functools import cache
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
    # A smoke run of the checkpoint path: a sliding-window layer and a global one.
    "tiny-sliding": {
        "model_type": "gemma3_text",
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "query_pre_attn_scalar": 64,
        "sliding_window": 32,
        "sliding_window_pattern": 2,
        "vocab_size": 49152,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "max_position_embeddings": 32768,
    },
}

GROUP_SIZE, BITS = 64, 4
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def config_of(shape: str) -> dict:
    if shape not in SHAPES:
        raise UserError(f"Unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    return dict(SHAPES[shape])


def random_model(
    shape: str, dtype: mx.Dtype = mx.bfloat16, seed: int = 0, words: Sequence[int] = ()
) -> nn.Module:
    """The shape's architecture with random weights, 4-bit like a typical download.
    With `words` (token ids, see `word_tokens`) only those tokens can be its output."""
    from mlx_lm.utils import _get_classes

    config = config_of(shape)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(dtype)
    if words:
        _only_words_out(model, words)
    nn.quantize(model, group_size=GROUP_SIZE, bits=BITS)
    mx.eval(model.parameters())
    return model


@cache
def word_tokens(tokenizer_json: Path) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(spaced, bare): tokens that decode to " " + ASCII letters, or to letters alone,
    and that the tokenizer encodes back to that one token. Random weights otherwise
    pick byte fragments, whose text does not survive a decode and re-encode as a real
    model's replies do, and a reopened conversation would not extend its saved tokens."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    candidates = []
    for token_id in range(tokenizer.get_vocab_size()):
        text = tokenizer.decode([token_id])
        word = text[1:] if text.startswith(" ") else text
        if len(word) > 1 and word.isascii() and word.isalpha():
            candidates.append((token_id, text))
    encoded = tokenizer.encode_batch([text for _, text in candidates], add_special_tokens=False)
    pairs = zip(candidates, encoded, strict=True)
    kept = [(tid, text) for (tid, text), e in pairs if e.ids == [tid]]
    spaced = tuple(tid for tid, text in kept if text.startswith(" "))
    return spaced, tuple(tid for tid, text in kept if not text.startswith(" "))


def _only_words_out(model: nn.Module, words: Sequence[int]) -> None:
    """Zero every output row but the words': their logits are exactly 0, and among
    thousands of random word rows some logit is positive for any hidden state, so
    greedy decoding picks a word. (A tied embedding then feeds zeros for the other
    tokens: harmless for a bench.)"""
    head = _output_rows(model)
    keep = mx.zeros((head.weight.shape[0], 1), dtype=head.weight.dtype)
    keep[mx.array(list(words))] = 1
    head.weight = head.weight * keep


def _output_rows(model: nn.Module) -> nn.Module:
    """The module whose weight rows make the logits: `lm_head`, or the tied embedding."""
    for owner in (model, getattr(model, "language_model", None)):
        if owner is not None and "lm_head" in owner:
            return owner.lm_head
    return next(m for _, m in model.named_modules() if isinstance(m, nn.Embedding))


def model_folder(shape: str, tokenizer_dir: Path, out_dir: Path) -> Path:
    """Write the shape as a model folder under `out_dir`, with `tokenizer_dir`'s
    tokenizer (its ids are below every shape's vocabulary size); return the folder.

    Its only outputs are bare words (no leading space): `bench reopen` asks one-token
    replies, each the first token after "assistant\n", where a real model writes a
    bare word too. A spaced one is stored trimmed, so the saved tokens would not be
    a prefix of the re-rendered conversation and a checkpointed (sliding or hybrid)
    cache could not be reused."""
    folder = Path(out_dir) / f"random-{shape}"
    folder.mkdir(parents=True, exist_ok=True)
    _, bare = word_tokens(Path(tokenizer_dir) / "tokenizer.json")
    weights = dict(tree_flatten(random_model(shape, words=bare).parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, {"format": "mlx"})
    config = {**config_of(shape), "quantization": {"group_size": GROUP_SIZE, "bits": BITS}}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copy(Path(tokenizer_dir) / name, folder / name)
    return folder
