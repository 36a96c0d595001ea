"""A tiny random llama model, written as a GGUF file the way llama.cpp lays it out.

Fast engine tests import it with the real importer and run it with the real
engine; only the weights are random. `write_gguf` takes overrides so tests can
produce broken files (wrong architecture, no tokenizer, ...).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from tokenizers import pre_tokenizers

HIDDEN = 128
LAYERS = 2
HEADS = 4
KV_HEADS = 2
FFN = 128
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MERGES = ["Ġ t", "h e", "Ġt he", "i n"]


def vocabulary() -> list[str]:
    tokens = list(SPECIAL) + sorted(pre_tokenizers.ByteLevel.alphabet())
    for merge in MERGES:
        tokens.append(merge.replace(" ", ""))
    return tokens


def metadata(**overrides) -> dict:
    tokens = vocabulary()
    meta = {
        "general.architecture": "llama",
        "general.name": "tiny-random-llama",
        "llama.embedding_length": mx.array(HIDDEN, dtype=mx.uint32),
        "llama.block_count": mx.array(LAYERS, dtype=mx.uint32),
        "llama.feed_forward_length": mx.array(FFN, dtype=mx.uint32),
        "llama.attention.head_count": mx.array(HEADS, dtype=mx.uint32),
        "llama.attention.head_count_kv": mx.array(KV_HEADS, dtype=mx.uint32),
        "llama.attention.layer_norm_rms_epsilon": mx.array(1e-5, dtype=mx.float32),
        "llama.rope.freq_base": mx.array(10000.0, dtype=mx.float32),
        "llama.context_length": mx.array(2048, dtype=mx.uint32),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": list(MERGES),
        "tokenizer.ggml.token_type": mx.array(
            [3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL)), dtype=mx.int32
        ),
        "tokenizer.ggml.bos_token_id": mx.array(1, dtype=mx.uint32),
        "tokenizer.ggml.eos_token_id": mx.array(2, dtype=mx.uint32),
        "tokenizer.ggml.padding_token_id": mx.array(0, dtype=mx.uint32),
        "tokenizer.chat_template": CHATML,
    }
    for key, value in overrides.items():
        if value is None:
            meta.pop(key, None)
        else:
            meta[key] = value
    return meta


def tensors(seed: int = 0) -> dict[str, mx.array]:
    mx.random.seed(seed)
    head_dim = HIDDEN // HEADS
    vocab = len(vocabulary())

    def rand(*shape: int) -> mx.array:
        return (0.2 * mx.random.normal(shape)).astype(mx.float16)

    arrays = {
        "token_embd.weight": rand(vocab, HIDDEN),
        "output_norm.weight": mx.ones((HIDDEN,), dtype=mx.float32),
    }
    for i in range(LAYERS):
        arrays |= {
            f"blk.{i}.attn_norm.weight": mx.ones((HIDDEN,), dtype=mx.float32),
            f"blk.{i}.ffn_norm.weight": mx.ones((HIDDEN,), dtype=mx.float32),
            f"blk.{i}.attn_q.weight": rand(HEADS * head_dim, HIDDEN),
            f"blk.{i}.attn_k.weight": rand(KV_HEADS * head_dim, HIDDEN),
            f"blk.{i}.attn_v.weight": rand(KV_HEADS * head_dim, HIDDEN),
            f"blk.{i}.attn_output.weight": rand(HIDDEN, HEADS * head_dim),
            f"blk.{i}.ffn_gate.weight": rand(FFN, HIDDEN),
            f"blk.{i}.ffn_up.weight": rand(FFN, HIDDEN),
            f"blk.{i}.ffn_down.weight": rand(HIDDEN, FFN),
        }
    return arrays


def write_gguf(path: Path, arrays: dict | None = None, **meta_overrides) -> Path:
    mx.save_gguf(str(path), tensors() if arrays is None else arrays, metadata(**meta_overrides))
    return path
