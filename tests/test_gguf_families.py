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

import json

import gguf_models as gm
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model

from app.engine.gguf_child import import_in_child
from app.engine.gguf_import import GGUFImportError


@pytest.mark.parametrize(
    ("arch", "tied"), [("llama", False), ("qwen2", True), ("qwen2", False), ("qwen3", True)]
)
def test_imported_model_gives_the_reference_logits(tmp_path, arch, tied):
    config = gm.config(arch, tied)
    reference = gm.reference(config)
    gguf = tmp_path / f"{arch}.gguf"
    tensors = gm.gguf_tensors(reference, arch)
    assert ("output.weight" in tensors) is not tied
    mx.save_gguf(str(gguf), tensors, gm.metadata(arch, config))

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
    config = gm.config("qwen2", True)
    gguf = tmp_path / "q.gguf"
    mx.save_gguf(
        str(gguf), gm.gguf_tensors(gm.reference(config), "qwen2"), gm.metadata("qwen2", config)
    )
    imported = import_in_child(gguf, tmp_path / "models", "q")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(imported.path / "tokenizer.json"))
    pieces = [tokenizer.decode([i]) for i in tokenizer.encode("in 2024 the").ids]
    assert pieces[pieces.index("2") : pieces.index("2") + 4] == ["2", "0", "2", "4"]
    assert " the" in pieces


def test_a_qwen2_file_without_its_attention_biases_is_refused(tmp_path):
    config = gm.config("qwen2", True)
    tensors = gm.gguf_tensors(gm.reference(config), "qwen2")
    del tensors["blk.1.attn_k.bias"]
    gguf = tmp_path / "nobias.gguf"
    mx.save_gguf(str(gguf), tensors, gm.metadata("qwen2", config))
    with pytest.raises(GGUFImportError, match=r"layer 1's self_attn\.k_proj bias"):
        import_in_child(gguf, tmp_path / "models", "nobias")
    assert not (tmp_path / "models").exists() or not list((tmp_path / "models").iterdir())


def test_an_unknown_architecture_names_the_ones_supported(tmp_path):
    config = gm.config("qwen2", True)
    gguf = tmp_path / "falcon.gguf"
    tensors = gm.gguf_tensors(gm.reference(config), "qwen2")
    mx.save_gguf(
        str(gguf), tensors, gm.metadata("qwen2", config, **{"general.architecture": "falcon"})
    )
    supported = "gemma2, gemma3, llama, phi3, qwen2, qwen3"
    with pytest.raises(GGUFImportError, match=rf"'falcon' model; only .*{supported}"):
        import_in_child(gguf, tmp_path / "models", "falcon")


@pytest.mark.parametrize("type_name", ["Q5_0", "IQ4_NL"])
def test_unsupported_tensor_types_are_refused_by_name(tmp_path, type_name):
    config = gm.config("llama", False) | {"intermediate_size": 256}
    tensors = gm.gguf_tensors(gm.reference(config), "llama")
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = np.zeros((gm.HIDDEN, 256 // block * size), dtype=np.uint8)
    gguf_path = tmp_path / "odd.gguf"
    meta = gm.metadata("llama", config)
    gm.write_with_gguf_package(
        gguf_path, "llama", tensors, {"blk.0.ffn_down.weight": (data, type_name)}, meta
    )
    with pytest.raises(GGUFImportError, match=f"blk.0.ffn_down.weight as {type_name}, which"):
        import_in_child(gguf_path, tmp_path / "models", "odd")
    assert not (tmp_path / "models").exists() or not list((tmp_path / "models").iterdir())
