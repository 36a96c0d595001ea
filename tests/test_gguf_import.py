"""Importing GGUF files: the tiny model's round trip, and every way a file can be bad."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

import tiny
from app.engine.gguf_import import GGUFImportError, import_gguf
from app.engine.loading import load


def test_tiny_gguf_imports_into_a_loadable_model(tmp_path):
    gguf = tiny.write_gguf(tmp_path / "tiny.gguf")
    imported = import_gguf(gguf, tmp_path / "models", "tiny")

    config = json.loads((imported.path / "config.json").read_text())
    assert config["rope_traditional"] is True  # llama.cpp's Q/K layout
    assert config["num_key_value_heads"] == tiny.KV_HEADS
    template = json.loads((imported.path / "tokenizer_config.json").read_text())["chat_template"]
    assert template == tiny.CHATML

    loaded = load(imported.path)
    text = "the 2024 theme, in 3 words"
    ids = loaded.tokenizer.encode(text, add_special_tokens=False)
    assert loaded.tokenizer.decode(ids) == text
    # SmolLM's pre-tokenizer splits numbers into single digits, and merges apply.
    pieces = [loaded.tokenizer.decode([i]) for i in ids]
    start = pieces.index("2")
    assert pieces[start : start + 4] == ["2", "0", "2", "4"]
    assert " the" in pieces
    # Chat markers are single special tokens.
    assert len(loaded.tokenizer.encode("<|im_start|>", add_special_tokens=False)) == 1


def test_starter_gguf_imports_with_its_mixed_quantization(starter_model_dir):
    config = json.loads((starter_model_dir / "config.json").read_text())
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 32
    # Q8_0 token embeddings arrive as 8-bit: the per-layer override says so.
    assert config["quantization"]["model.embed_tokens"] == {"group_size": 32, "bits": 8}
    assert config["num_hidden_layers"] == 30 and config["tie_word_embeddings"] is True


def _leaves_nothing(models_dir):
    return not models_dir.exists() or list(models_dir.iterdir()) == []


def test_truncated_gguf_is_refused_and_leaves_nothing(tmp_path):
    whole = tiny.write_gguf(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(GGUFImportError, match="past the end of the file"):
        import_gguf(cut, tmp_path / "models", "cut")
    assert _leaves_nothing(tmp_path / "models")


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    fake = tmp_path / "notes.gguf"
    fake.write_text("just some text")
    with pytest.raises(GGUFImportError, match="not a GGUF file"):
        import_gguf(fake, tmp_path / "models")


def test_other_architectures_are_refused(tmp_path):
    gguf = tiny.write_gguf(tmp_path / "gpt2.gguf", **{"general.architecture": "gpt2"})
    with pytest.raises(GGUFImportError, match="only these GGUF architectures"):
        import_gguf(gguf, tmp_path / "models")
    assert _leaves_nothing(tmp_path / "models")


@pytest.mark.parametrize(
    ("missing", "message"),
    [
        ("tokenizer.ggml.tokens", "no tokenizer"),
        ("tokenizer.chat_template", "no chat template"),
        ("llama.block_count", "llama.block_count"),
    ],
)
def test_missing_metadata_is_named(tmp_path, missing, message):
    gguf = tiny.write_gguf(tmp_path / "broken.gguf", **{missing: None})
    with pytest.raises(GGUFImportError, match=message):
        import_gguf(gguf, tmp_path / "models")
    assert _leaves_nothing(tmp_path / "models")


def test_missing_layer_weights_are_named(tmp_path):
    arrays = tiny.tensors()
    del arrays["blk.1.ffn_up.weight"]
    gguf = tiny.write_gguf(tmp_path / "holes.gguf", arrays)
    with pytest.raises(GGUFImportError, match=r"layer 1's mlp\.up_proj"):
        import_gguf(gguf, tmp_path / "models")


def test_other_tokenizer_types_are_refused_clearly(tmp_path):
    gguf = tiny.write_gguf(tmp_path / "wpm.gguf", **{"tokenizer.ggml.model": "bert"})
    with pytest.raises(GGUFImportError, match="'bert' is not supported yet"):
        import_gguf(gguf, tmp_path / "models")
    assert _leaves_nothing(tmp_path / "models")


def test_an_existing_model_is_not_overwritten(tmp_path):
    gguf = tiny.write_gguf(tmp_path / "tiny.gguf")
    first = import_gguf(gguf, tmp_path / "models", "tiny")
    before = (first.path / "model.safetensors").stat().st_mtime_ns
    with pytest.raises(GGUFImportError, match="already exists"):
        import_gguf(gguf, tmp_path / "models", "tiny")
    assert (first.path / "model.safetensors").stat().st_mtime_ns == before


def test_an_interrupted_import_leaves_no_folder(tmp_path, monkeypatch):
    gguf = tiny.write_gguf(tmp_path / "tiny.gguf")

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mx, "save_safetensors", full_disk)
    with pytest.raises(OSError, match="No space left"):
        import_gguf(gguf, tmp_path / "models", "tiny")
    assert _leaves_nothing(tmp_path / "models")


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("llama.block_count", "two", "llama.block_count is not a number"),
        ("llama.embedding_length", mx.array([1, 2], dtype=mx.uint32), "is not a number"),
        ("llama.attention.head_count", mx.array(0, dtype=mx.uint32), r"head_count \(0\) is not"),
        ("llama.attention.layer_norm_rms_epsilon", mx.array(float("nan")), "is not a number"),
        ("tokenizer.ggml.merges", ["a b c"], "merge 'a b c' is not two tokens"),
        ("tokenizer.ggml.merges", ["x y"], "tokenizer could not be built"),
    ],
)
def test_metadata_of_the_wrong_kind_is_refused_clearly(tmp_path, key, value, message):
    gguf = tiny.write_gguf(tmp_path / "odd.gguf", **{key: value})
    with pytest.raises(GGUFImportError, match=message):
        import_gguf(gguf, tmp_path / "models")
    assert _leaves_nothing(tmp_path / "models")


def test_special_token_ids_past_the_vocabulary_are_ignored(tmp_path):
    gguf = tiny.write_gguf(
        tmp_path / "ids.gguf", **{"tokenizer.ggml.bos_token_id": mx.array(10**6, dtype=mx.uint32)}
    )
    imported = import_gguf(gguf, tmp_path / "models", "ids")
    config = json.loads((imported.path / "tokenizer_config.json").read_text())
    assert config["bos_token"] is None and config["eos_token"] == "<|im_end|>"
