"""A GGUF file with a SentencePiece vocabulary (Llama 2, Mistral) imports with a tokenizer
that encodes text exactly as SentencePiece itself does.

The reference is a real SentencePiece BPE model, trained here on a few lines with
byte fallback and Llama's settings (no normalization, a space put before the
text); its pieces, scores and types go into the GGUF file as llama.cpp's
converter writes them.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
import sentencepiece as spm
from tokenizers import Tokenizer

import tiny
from app.engine.gguf_child import import_in_child
from app.engine.gguf_import import GGUFImportError

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Models people run at home: Mistral, Llama and Qwen, in 4-bit files.",
    "She said: 'it is 2024, and the weather is fine' -- then left at 10:45.",
    "Résumé, café and naïve are words with accents.",
    "    indented code(x) = return x + 1;  # comment",
    "numbers 1234567890 and symbols !@#$%^&*()[]{}",
] * 20
SAMPLES = [
    "Hello world",
    " leading space and  two spaces",
    "The lazy fox, in 2024!",
    "line one\nline two\n\n  indented",
    "Résumé of a naïve café",
    "unseen: 日本語 and emoji 🙂 and ß",
    "",
    "x",
]
# llama.cpp's token types: normal, unknown, control, user defined, unused, byte.
_NORMAL, _UNKNOWN, _CONTROL, _UNUSED, _BYTE = 1, 2, 3, 5, 6


def _train(folder, space_prefix: bool = True) -> spm.SentencePieceProcessor:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_prefix=str(folder / "m"),
        model_type="bpe",
        vocab_size=400,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=space_prefix,
        character_coverage=1.0,
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_file=str(folder / "m.model"))


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("spm"))


def _piece_type(sp, i: int) -> int:
    if sp.is_unknown(i):
        return _UNKNOWN
    if sp.is_control(i):
        return _CONTROL
    if sp.is_byte(i):
        return _BYTE
    return _UNUSED if sp.is_unused(i) else _NORMAL


def _gguf(path, sp, **overrides):
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    meta = tiny.metadata(
        **{
            "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.pre": None,
            "tokenizer.ggml.merges": None,
            "tokenizer.ggml.tokens": pieces,
            "tokenizer.ggml.scores": mx.array(
                [sp.get_score(i) for i in range(len(pieces))], dtype=mx.float32
            ),
            "tokenizer.ggml.token_type": mx.array(
                [_piece_type(sp, i) for i in range(len(pieces))], dtype=mx.int32
            ),
            "tokenizer.ggml.bos_token_id": mx.array(sp.bos_id(), dtype=mx.uint32),
            "tokenizer.ggml.eos_token_id": mx.array(sp.eos_id(), dtype=mx.uint32),
            "tokenizer.ggml.unknown_token_id": mx.array(sp.unk_id(), dtype=mx.uint32),
            "tokenizer.ggml.padding_token_id": None,
        }
        | overrides
    )
    arrays = tiny.tensors()
    arrays["token_embd.weight"] = mx.zeros((len(pieces), tiny.HIDDEN), dtype=mx.float16)
    mx.save_gguf(str(path), arrays, meta)
    return path


def test_sentencepiece_vocabulary_encodes_like_sentencepiece(tmp_path, sentencepiece_model):
    sp = sentencepiece_model
    imported = import_in_child(_gguf(tmp_path / "spm.gguf", sp), tmp_path / "models", "spm")
    tokenizer = Tokenizer.from_file(str(imported.path / "tokenizer.json"))
    for text in SAMPLES + CORPUS[:6]:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert ids == sp.encode(text), text
        assert tokenizer.decode(ids) == text
    # Characters the vocabulary lacks fall back to byte pieces, not <unk>.
    assert sp.unk_id() not in tokenizer.encode("日本語 🙂").ids
    # Control pieces are single special tokens.
    assert tokenizer.encode("</s>", add_special_tokens=False).ids == [sp.eos_id()]


def test_a_vocabulary_without_the_space_prefix_encodes_like_sentencepiece(tmp_path):
    sp = _train(tmp_path, space_prefix=False)
    gguf = _gguf(tmp_path / "np.gguf", sp, **{"tokenizer.ggml.add_space_prefix": mx.array(False)})
    imported = import_in_child(gguf, tmp_path / "models", "np")
    tokenizer = Tokenizer.from_file(str(imported.path / "tokenizer.json"))
    for text in SAMPLES:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert ids == sp.encode(text), text
        assert tokenizer.decode(ids) == text


def test_imported_sentencepiece_model_loads_and_chats(tmp_path, sentencepiece_model):
    from app.engine.loading import load

    sp = sentencepiece_model
    imported = import_in_child(_gguf(tmp_path / "spm.gguf", sp), tmp_path / "models", "spm")
    loaded = load(imported.path)
    assert loaded.tokenizer.encode("Hello world", add_special_tokens=False) == sp.encode(
        "Hello world"
    )
    assert loaded.tokenizer.eos_token_id == sp.eos_id()


def test_sentencepiece_scores_that_do_not_match_the_tokens_are_refused(
    tmp_path, sentencepiece_model
):
    gguf = _gguf(
        tmp_path / "bad.gguf",
        sentencepiece_model,
        **{"tokenizer.ggml.scores": mx.array([0.0, 1.0], dtype=mx.float32)},
    )
    with pytest.raises(GGUFImportError, match="different number of tokens and scores"):
        import_in_child(gguf, tmp_path / "models", "bad")
    assert not (tmp_path / "models").exists() or not list((tmp_path / "models").iterdir())
