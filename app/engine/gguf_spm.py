"""A Hugging Face tokenizer rebuilt from a GGUF SentencePiece vocabulary (Llama 2, Mistral).

GGUF files with `tokenizer.ggml.model == "llama"` carry SentencePiece's pieces, a
score per piece and a type per piece, but no merges. SentencePiece's BPE encoder
repeatedly joins the adjacent pair whose joined piece has the highest score, so a
Hugging Face BPE model whose merges are every (left, right) split of every piece,
ranked by that piece's score, encodes the same way (this is how transformers
converts Llama tokenizers too). Text the vocabulary cannot spell falls back to the
`<0xNN>` byte pieces (`byte_fallback`). As in SentencePiece, spaces become "▁" and
one "▁" is put before the text (unless the file says
`tokenizer.ggml.add_space_prefix` false); the decoder undoes both.
"""

from __future__ import annotations

import mlx.core as mx

from app.engine.gguf_check import GGUFImportError

SPACE = "\u2581"  # SentencePiece's visible space, "▁"
_UNKNOWN, _CONTROL, _UNUSED, _BYTE = 2, 3, 5, 6


def _merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    vocab = {token: i for i, token in enumerate(tokens)}
    ranked = []
    for i, token in enumerate(tokens):
        if types[i] in (_UNKNOWN, _CONTROL, _UNUSED, _BYTE) or len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                # Highest score first; among equal scores, the earlier piece, then the
                # split whose left part came earlier in the vocabulary.
                ranked.append((-scores[i], i, vocab[left], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def sentencepiece_tokenizer(
    tokens: object, scores: object, types: object, space_prefix: bool = True
):
    """The `tokenizers.Tokenizer` for a SentencePiece vocabulary; `GGUFImportError` if unusable."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    if not isinstance(tokens, list) or not isinstance(scores, mx.array):
        raise GGUFImportError("The GGUF tokenizer's tokens or scores are missing or not lists")
    scores = scores.tolist()
    types = types.tolist() if isinstance(types, mx.array) else [1] * len(tokens)
    if len(scores) != len(tokens) or len(types) != len(tokens):
        raise GGUFImportError("The GGUF tokenizer has a different number of tokens and scores")
    unknown = next((t for t, kind in zip(tokens, types, strict=True) if kind == _UNKNOWN), None)
    vocab = {token: i for i, token in enumerate(tokens)}
    try:
        model = models.BPE(
            vocab=vocab,
            merges=_merges(tokens, scores, types),
            unk_token=unknown,
            fuse_unk=True,
            byte_fallback=True,
        )
    except Exception as exc:  # tokenizers raises a bare Exception for a bad vocabulary
        raise GGUFImportError(f"The GGUF tokenizer could not be built: {exc}") from exc
    tokenizer = Tokenizer(model)
    # `tokenizer.ggml.add_space_prefix` false (SentencePiece's add_dummy_prefix off):
    # no "▁" before the text, and none to strip when decoding.
    prefix = [normalizers.Prepend(SPACE)] if space_prefix else []
    tokenizer.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", SPACE)])
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tokenizer
