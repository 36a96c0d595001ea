"""Where a quantized cache's chunk files keep the 16-bit copies of its recent rows.

A layer of the app's 8-bit or 4-bit cache holds its last `window` tokens in 16
bits (app/engine/kvwindow.py), and a cache restored from files is the live one
only with those rows as they are. Each chunk carries a copy of its own positions
in that tail when it is written ("r<first>-<end>k", `MixedKVCache.quantized_tokens`),
so a turn writes its new rows once in each form. Once the tail has moved past a
chunk, that chunk is written again without its copy (`CopyPlan.passed`), once in
its life, so that a chat keeps about a window of copies on disk (the chunk the
window begins in holds the rest of its copy); a chunk another chat still needs the
copy of keeps it. After a cut (the tail then holds dequantized rows), or where
the chunks kept lack their copies (another chat went on past them), the save's last
chunk carries the whole tail, which a restore takes over the older copies
(`kvwindow.covering_copies`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from app.engine.kvscheme import KVScheme, parse_format
from app.engine.kvwindow import copy_span, covering_copies, tail_start_at
from sessions.cachefiles import ConversationCache, tensor_names

if TYPE_CHECKING:
    from app.engine.kvstore import KVStore

Chunk = tuple[str, int, int]  # key, first token, end


@dataclass(frozen=True)
class CopyPlan:
    """What a save does about the copies: `whole_tail`, its last chunk carries the
    whole tail (written again if it was kept); `passed`, kept chunks whose copies
    the tail has left behind, to write again without them."""

    whole_tail: bool = False
    passed: list[Chunk] = field(default_factory=list)


def plan(
    store: KVStore,
    conversation_id: int,
    previous: ConversationCache | None,
    fmt: str,
    chunks: list[Chunk],
    kept: set[str],
    dequantized: bool = False,
) -> CopyPlan:
    """The copies' part of saving `chunks` (the whole cache, in order) in `fmt`, where
    the `kept` ones are on disk already and the others are written. `dequantized`: the
    live tail holds rows a cut moved back from the quantized bulk
    (`MixedKVCache.tail_is_dequantized`), which the kept chunks' copies hold as they
    were computed; an unchanged message sent again can give the same reply, and so
    the same chunks, with nothing new to write."""
    scheme = _scheme(fmt)
    if scheme is None or not chunks:
        return CopyPlan()
    count = chunks[-1][2]
    tail = tail_start_at(count, scheme)
    new_from = next((start for key, start, _ in chunks if key not in kept), count)
    whole_tail = dequantized
    if not whole_tail and tail < new_from:  # the kept chunks must hold [tail, new_from)
        held = [chunk for chunk in chunks if chunk[0] in kept and chunk[2] > tail]
        spans = [span for chunk in held if (span := _copy_span(store, chunk, scheme))]
        whole_tail = covering_copies(spans, tail, new_from) is None
    # The tail of the previous save: chunks that ended before it were seen to then.
    before = len(previous.tokens) if previous and previous.kv_format == fmt else 0
    since = tail_start_at(before, scheme) if before else 0
    candidates = [
        chunk
        for chunk in chunks
        if chunk[0] in kept and since < chunk[2] <= tail and _copy_span(store, chunk, scheme)
    ]
    others = store.index.other_caches(conversation_id) if candidates else []
    passed = [chunk for chunk in candidates if not _needed_elsewhere(others, chunk, scheme)]
    return CopyPlan(whole_tail, passed)


def _scheme(fmt: str) -> KVScheme | None:
    """The scheme of a format whose layers hold recent rows in 16 bits; None for others."""
    try:
        scheme = parse_format(fmt)
    except ValueError:
        return None
    return scheme if scheme.key_bits or scheme.value_bits else None


def _copy_span(store: KVStore, chunk: Chunk, scheme: KVScheme) -> tuple[int, int] | None:
    """(first, end) of the positions the chunk's file holds a 16-bit copy of, from its
    header alone; None when it holds none (or cannot be read)."""
    names = tensor_names(store.index.chunk_path(chunk[0])) or set()
    spans = {copy_span(name.split(".", 1)[-1], scheme) for name in names}
    spans = {span[:2] for span in spans if span and span[1] == chunk[2]}
    return min(spans) if spans else None


def _needed_elsewhere(
    others: list[tuple[frozenset[str] | None, int]], chunk: Chunk, scheme: KVScheme
) -> bool:
    """Whether another conversation (`CacheIndex.other_caches`) holds the chunk with its
    copy still in its tail."""
    return any(
        keys is None or (chunk[0] in keys and tail_start_at(length, scheme) < chunk[2])
        for keys, length in others
    )
