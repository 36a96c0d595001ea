"""A turn's prompt that keeps as many of the tokens the model has already seen as
its text allows, so that the cache holding them stays usable.

A reply's own tokens need not survive a decode/encode round trip ("Hel" + "lo"
where the tokenizer would write "Hello"), and a chat template may write an
earlier reply otherwise than the model wrote it (a reasoning model's template
drops its thinking). Encoding the rendered conversation afresh would then part
from the cached tokens at the first such token and recompute everything after
it; for a model whose cache cannot be cut back (sliding windows, recurrent
layers) that meant everything after the last checkpoint it could still use.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from app.engine.steps import common_prefix_length

Decode = Callable[[list[int]], str]
Encode = Callable[[str], list[int]]


def prompt_tokens(
    text: str, known: Sequence[int], encode: Encode, decode: Decode, boundaries: frozenset[int]
) -> list[int]:
    """`text` as token ids, starting with the longest prefix of `known` that spells its
    start and ends at a token in `boundaries` (or is the whole of `known`); the rest
    encoded. Where no such prefix beats the plain encoding's agreement with `known`,
    the plain encoding."""
    known = list(known)
    if known:
        spelled = decode(known)
        if text.startswith(spelled):  # a turn that goes on from the cache: the usual case
            return [*known, *encode(text[len(spelled) :])]
    plain = encode(text)
    agreed = common_prefix_length(plain, known)
    kept = _last_boundary(known, longest_spelled_prefix(text, known, decode), boundaries)
    if kept <= agreed:
        return plain
    # Tokens after an added token (a chat marker) mostly encode alone as they do in
    # context: the tokenizer splits those out first. Not always (a marker that eats the
    # space after it, a first word spelled with a leading space): checked.
    joined = [*known[:kept], *encode(text[len(decode(known[:kept])) :])]
    return joined if decode(joined) == text else plain


def longest_spelled_prefix(text: str, known: list[int], decode: Decode) -> int:
    """The largest n (by bisection) such that `known[:n]` decodes to a start of `text`.
    A cut inside a character (a byte-level tokenizer splits some in up to four tokens)
    decodes to a replacement mark, so each probe also tries the three cuts before it;
    every n it returns holds."""

    def spells(n: int) -> bool:
        return text.startswith(decode(known[:n]))

    low, high = 0, len(known)  # known[:low] spells a start of text; nothing past high does
    while low < high:
        middle = (low + high + 1) // 2
        held = next((n for n in range(middle, max(low, middle - 4), -1) if spells(n)), None)
        if held is None:  # four cuts in a row that do not spell: the text parted before
            high = max(low, middle - 4)
        else:
            low = held
    return low


def _last_boundary(known: list[int], end: int, boundaries: frozenset[int]) -> int:
    """Where the prefix `known[:end]` last ends just after a token in `boundaries`."""
    for n in range(end, 0, -1):
        if known[n - 1] in boundaries:
            return n
    return 0


def boundary_ids(tokenizer: object) -> frozenset[int]:
    """Ids after which the tokenizer starts afresh: its added tokens (chat markers,
    special tokens), which it splits out of a text before encoding the pieces."""
    tokenizer = getattr(tokenizer, "_tokenizer", tokenizer)
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return frozenset(added) | frozenset(getattr(tokenizer, "all_special_ids", ()) or ())
