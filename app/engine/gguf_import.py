"""Import a GGUF file (llama, qwen2, qwen3, qwen3moe, gemma2, gemma3, phi3) into an MLX folder.

- the file's structure and metadata read and checked by our own reader
  (`gguf_check`), and its tensors read from the verified offsets and stored as
  MLX affine-quantized or float weights at the precision asked for
  (`gguf_tensors`, `gguf_kquants`); no native GGUF reader sees the file;
- tensor names and metadata mapped to mlx-lm's layout and config, per
  architecture, with the rope layout llama.cpp's converter left (`gguf_arch`);
- a Hugging Face `tokenizer.json` rebuilt from the GGUF vocabulary: byte-level
  BPE from its merges, or SentencePiece from its scores (`gguf_spm`), plus the
  chat template from `tokenizer.chat_template`.

The folder is assembled under a hidden temporary name and renamed into place
only when complete, so a failed import leaves nothing behind.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from app.engine.gguf_arch import (
    architecture_of,
    map_weights,
    meta_count,
    meta_num,
    meta_str,
    model_config,
)
from app.engine.gguf_check import GGUFImportError, check_gguf
from app.engine.gguf_spm import sentencepiece_tokenizer
from app.engine.gguf_tensors import read_tensors
from app.engine.models import check_name, file_sha256, staged_folder

__all__ = ["GGUFImportError", "ImportedModel", "import_gguf"]

# Pre-tokenizer splitting rules, by GGUF `tokenizer.ggml.pre`. These are the
# regular expressions the original Hugging Face tokenizers use.
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZERS = {
    # name: (split digits one by one first, splitting regex)
    "default": (False, _GPT2_SPLIT),
    "gpt2": (False, _GPT2_SPLIT),
    "smollm": (True, _GPT2_SPLIT),
    "starcoder": (True, _GPT2_SPLIT),
    "refact": (True, _GPT2_SPLIT),
    "llama-bpe": (False, _LLAMA3_SPLIT),
    "llama3": (False, _LLAMA3_SPLIT),
    # Qwen2's own regex is llama 3's with numbers split into single digits.
    "qwen2": (False, _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")),
}
_CONTROL_TOKEN = 3
_USER_DEFINED_TOKEN = 4

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class ImportedModel:
    name: str
    path: Path
    architecture: str
    weights: str = ""  # how the weights are stored, e.g. "Q4_K as 4-bit (exact), ...; 1.2 GB"


def import_gguf(
    gguf_path: Path,
    models_dir: Path,
    name: str | None = None,
    progress: Progress | None = None,
    bits: int | None = None,
) -> ImportedModel:
    """Convert `gguf_path` into `models_dir/name`, atomically.

    `bits`: None stores each tensor at its own precision; 4 or 8 every matrix at that
    many bits; 16 everything as float16 (`gguf_tensors` says what each means)."""
    report = progress or (lambda stage, done, total: None)
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise GGUFImportError(f"No such file: {gguf_path}")
    name = name or gguf_path.stem
    check_name(name)
    target = models_dir / name
    if target.exists():
        raise GGUFImportError(f"A model named {name!r} already exists in {models_dir}")

    report("Reading the file", 0, 4)
    layout = check_gguf(gguf_path)
    meta = layout.metadata
    tensors, stored = read_tensors(gguf_path, layout, bits)
    arch = architecture_of(meta, gguf_path.name)
    report("Building the tokenizer", 1, 4)
    context = meta_count(meta, f"{arch.gguf_name}.context_length", 4096)
    tokenizer_json, tokenizer_config = _tokenizer_files(meta, context)
    report("Converting the weights", 2, 4)
    weights = map_weights(arch, tensors)
    config = model_config(arch, meta, weights)

    with staged_folder(models_dir, name, "import") as staging:
        report("Saving the model", 3, 4)
        mx.save_safetensors(str(staging / "model.safetensors"), weights, {"format": "mlx"})
        size = (staging / "model.safetensors").stat().st_size
        config["reprise"] = {
            "source": "gguf",
            "gguf_file": gguf_path.name,
            "gguf_bytes": layout.file_size,
            "gguf_sha256": file_sha256(gguf_path),
            "weights": stored,  # the library's weights line (it adds the size itself)
        }
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        (staging / "tokenizer.json").write_text(tokenizer_json)
        (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    report("Done", 4, 4)
    stored += f"; {size / 1e9:.2f} GB (the GGUF file: {layout.file_size / 1e9:.2f} GB)"
    return ImportedModel(name, target, arch.gguf_name, stored)


def _tokenizer_files(meta: dict, context_length: int) -> tuple[str, dict]:
    from tokenizers import AddedToken

    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFImportError("The GGUF file has no tokenizer (tokenizer.ggml.tokens is missing)")
    kind = meta_str(meta, "tokenizer.ggml.model")
    if kind == "gpt2" and meta.get("tokenizer.ggml.merges"):
        tokenizer = _byte_level_tokenizer(meta, tokens)
    elif kind == "llama":
        tokenizer = sentencepiece_tokenizer(
            tokens,
            meta.get("tokenizer.ggml.scores"),
            meta.get("tokenizer.ggml.token_type"),
            bool(meta_num(meta, "tokenizer.ggml.add_space_prefix", True)),
        )
    else:
        raise GGUFImportError(
            f"Tokenizer type {kind!r} is not supported yet; only byte-level BPE ('gpt2') "
            "and SentencePiece ('llama') are"
        )

    types = meta.get("tokenizer.ggml.token_type")
    types = types.tolist() if isinstance(types, mx.array) else [1] * len(tokens)
    special = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, kind_ in enumerate(types[: len(tokens)])
        if kind_ in (_CONTROL_TOKEN, _USER_DEFINED_TOKEN)
    ]
    tokenizer.add_special_tokens(special)

    def token_at(key: str) -> str | None:
        index = meta.get(key)
        if not isinstance(index, mx.array) or index.size != 1:
            return None
        position = int(index.item())
        return tokens[position] if 0 <= position < len(tokens) else None

    template = meta_str(meta, "tokenizer.chat_template")
    if not template:
        raise GGUFImportError("The GGUF file has no chat template (tokenizer.chat_template)")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token_at("tokenizer.ggml.bos_token_id"),
        "eos_token": token_at("tokenizer.ggml.eos_token_id"),
        "pad_token": token_at("tokenizer.ggml.padding_token_id"),
        "unk_token": token_at("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": bool(meta_num(meta, "tokenizer.ggml.add_bos_token", False)),
        "model_max_length": context_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": template,
    }
    return tokenizer.to_str(), config


def _byte_level_tokenizer(meta: dict, tokens: list):
    """GPT-2 style byte-level BPE, split first by the pre-tokenizer the file names."""
    from tokenizers import Regex, decoders, pre_tokenizers

    pre = meta_str(meta, "tokenizer.ggml.pre") or "default"
    if pre not in _PRE_TOKENIZERS:
        raise GGUFImportError(f"Pre-tokenizer {pre!r} is not supported yet")
    split_digits, pattern = _PRE_TOKENIZERS[pre]
    tokenizer = _bpe_tokenizer(tokens, meta.get("tokenizer.ggml.merges"))
    steps = [pre_tokenizers.Digits(individual_digits=True)] if split_digits else []
    steps += [
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _bpe_tokenizer(tokens: object, merges: object):
    """The BPE model from the GGUF vocabulary and merges; a damaged one is a user error."""
    from tokenizers import Tokenizer, models

    if not isinstance(tokens, list) or not isinstance(merges, list):
        raise GGUFImportError("The GGUF tokenizer's tokens or merges are not lists of text")
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ")) for m in merges]
    if any(len(pair) != 2 for pair in pairs):
        bad = next(m for m, pair in zip(merges, pairs, strict=True) if len(pair) != 2)
        raise GGUFImportError(f"The GGUF tokenizer's merge {bad!r} is not two tokens")
    try:
        return Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    except Exception as exc:  # tokenizers raises a bare Exception for a bad vocabulary
        raise GGUFImportError(f"The GGUF tokenizer could not be built: {exc}") from exc
