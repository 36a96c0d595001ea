"""Saving and restoring caches that cannot be cut along the token axis as a whole.

Sliding-window layers (`RotatingKVCache`) overwrite old positions and recurrent
layers (`ArraysCache`) hold a running state: neither can be cut into chunks. A
cache with such layers is saved in two parts:

- its full-attention layers (those a codec holds, `codecs.chunk_classes`) go
  into token chunks exactly as a plain model's whole cache does (kvstore): a
  turn writes only its own tokens, and branches share what they share;
- the other layers go into a checkpoint at the end of each turn (a snapshot,
  `app.engine.snapshots`, that names the chunked layers "in_chunks"), whose
  size follows the windows and states, not the history.

The conversation's entry lists both (`chunk_keys`, `checkpoint_keys`); its
`kv_format` is the chunks' (where there are none, the windows': a model of sliding
windows and recurrent layers; SNAPSHOT for states alone, or a whole snapshot saved
before chunks). A turn restores the
latest checkpoint whose tokens begin its prompt (an earlier one after an edit
or a regenerate) with the chunks of the tokens before it, trimmed to them.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
from mlx_lm.models.cache import ChunkedKVCache, RotatingKVCache, make_prompt_cache

from app.engine import checkpoint_chain, snapshots, window_rows
from app.engine.cache_keys import SNAPSHOT, cache_parts, checkpoint_key, kv_format, tokens_hash
from app.engine.checkpoint_chain import Point
from app.engine.codecs import ChunkManifest, chunk_classes, stored_dtype, stored_format
from app.engine.kvquant import MixedKVCache
from app.engine.stored_arrays import in_mlx, read_in_threads
from sessions.cachefiles import (
    CacheRejected,
    CacheUnreadable,
    ConversationCache,
    path_from_url,
    read_file,
)

# Checkpoint files read ahead of the one whose rows are being taken apart.
_READ_AHEAD = 4

if TYPE_CHECKING:
    from app.engine.kvstore import KVStore


def chunk_format(cache: list, sixteen_bit: str | None) -> str | None:
    """The format the cache's chunked layers are saved in; None when it has none, or
    when they differ (then the checkpoint holds every layer)."""
    parts = cache_parts(cache)
    held = [part for part, name in zip(parts, chunk_classes(cache), strict=True) if name]
    live = kv_format(held) if held else None
    return stored_format(live, sixteen_bit) if live else None


def windows_format(cache: list, sixteen_bit: str | None) -> str | None:
    """The format every window of a cache holds its rows in: the app's scheme's (8 or 4
    bits, or the CPU path's 16), or the type mlx-lm's windows are saved in; None where
    the cache has no window or its windows differ."""
    formats = set()
    for part in cache_parts(cache):
        if isinstance(part, MixedKVCache) and part.max_size is not None:
            formats.add(part.scheme.format)
        elif isinstance(part, RotatingKVCache | ChunkedKVCache) and part.keys is not None:
            formats.add(stored_format(str(part.keys.dtype).split(".")[-1], sixteen_bit))
    return formats.pop() if len(formats) == 1 else None


def _checkpoint_format(store: KVStore, cache: list, chunks: str | None) -> str:
    """The format a checkpoint's key and its chat's entry name: the chunks' (`chunks`);
    where no layer is chunked, the windows' (so that a changed KV preference leaves the
    checkpoints of the other one unused, as it leaves chunks); SNAPSHOT where neither
    says (recurrent states alone)."""
    return chunks or windows_format(cache, store.sixteen_bit) or SNAPSHOT


def _window_type(sixteen_bit: str | None) -> mx.Dtype | None:
    """The 16-bit type a float32 window is saved in: the model's own, as its chunks are
    (`stored_format`); None for a model of float32 weights."""
    fmt = stored_format("float32", sixteen_bit)
    return None if fmt == "float32" else stored_dtype(fmt)


@dataclass(frozen=True)
class Taken:
    """A checkpoint's contents taken during a turn, when the cache held its first
    `tokens` (its messages, before the generation prompt), written with its save."""

    tokens: int
    tensors: dict
    layout: str
    fmt: str  # its format then (`_checkpoint_format`): the layers it leaves to chunks


def take(store: KVStore, cache: list, tokens: int) -> Taken:
    """The checkpoint of `cache` as it is now, holding `tokens` tokens: its windows and
    states copied to host memory (the reply's tokens go on to change them)."""
    fmt, slots = _chunked_slots(store, cache)
    tensors, layout = snapshots.snapshot(cache, slots, _window_type(store.sixteen_bit))
    return Taken(tokens, tensors, layout, _checkpoint_format(store, cache, fmt))


def resume(store: KVStore, cache: list, taken: Taken) -> list:
    """The live `cache` back at `taken.tokens`, in memory: its chunked layers cut back
    there, the others from `taken`, as a restore from the files would have them. The
    live layers are only cut once the checkpoint has passed its checks."""
    template = make_prompt_cache(store.loaded.model)
    tensors = {name: mx.array(array) for name, array in taken.tensors.items()}
    shapes = store.loaded.attention_shapes
    restored, in_chunks = snapshots.restore_checkpoint(template, tensors, taken.layout, shapes)
    parts = cache_parts(cache)
    live = {slot: parts[slot] for slot in in_chunks}
    if any(type(layer).__name__ != in_chunks[slot] for slot, layer in live.items()):
        raise CacheRejected("the checkpoint and the cache disagree on the layers")
    if any(layer.offset < taken.tokens for layer in live.values()):
        raise CacheRejected("the cache is shorter than the checkpoint")
    for slot, layer in live.items():
        layer.trim(layer.offset - taken.tokens)
        snapshots.put_part(restored, slot, layer)
    mx.eval([layer.state for layer in restored])
    return restored


def _chunked_slots(store: KVStore, cache: list) -> tuple[str | None, list[int]]:
    """The chunks' format, and the slots of the layers they hold (none without one)."""
    fmt = chunk_format(cache, store.sixteen_bit)
    return fmt, [i for i, name in enumerate(chunk_classes(cache)) if name] if fmt else []


def save(
    store: KVStore,
    conversation_id: int,
    tokens: list[int],
    cache: list,
    taken: Taken | None = None,
) -> tuple[int, int, int]:
    """Chunks for the new tokens of the chunked layers, and a checkpoint of the others
    at the end of `tokens`, and one `taken` during the turn (before its generation
    prompt, app/engine/prompt_checkpoints.py); (files written, files reused, bytes)."""
    fmt, slots = _chunked_slots(store, cache)
    parts = cache_parts(cache)
    if any(parts[i].offset != len(tokens) for i in slots):
        store.index.forget_conversation(conversation_id)
        return 0, 0, 0
    previous = store.index.conversation(conversation_id)
    keys, written, reused, size = [], 0, 0, 0
    if slots:
        keys, written, reused, size = store.write_chunks(
            conversation_id, previous, fmt, tokens, cache
        )
    fmt = _checkpoint_format(store, cache, fmt)
    # A layer quantized during the reply ("full precision until N") is no longer what
    # the taken checkpoint held: that one would be refused, so it is not kept.
    if taken and not (0 < taken.tokens < len(tokens) and taken.fmt == fmt):
        taken = None
    # In token order: `pick` takes the last that fits.
    points = [(taken.tokens, lambda: (taken.tensors, taken.layout))] if taken else []
    window_type = _window_type(store.sixteen_bit)
    points.append((len(tokens), lambda: snapshots.snapshot(cache, slots, window_type)))
    earlier = _earlier_checkpoints(store, previous, fmt, tokens[: points[0][0]])
    new: list[Point] = []
    for end, contents in points:
        point, size_written = _write_checkpoint(
            store, (fmt, tokens[:end], len(cache)), contents, [*earlier, *new]
        )
        new.append(point)
        if size_written:
            written, size = written + 1, size + size_written
        else:
            reused += 1
    kept = [point.key for point in checkpoint_chain.kept([*earlier, *new])]
    # One stamp for the chat's chunks and checkpoints: eviction takes files used together
    # from their end (`CacheIndex.evict_to_budget`), chunks and checkpoints alike.
    store.index.touch([*keys, *kept])
    store.point_conversation(conversation_id, fmt, tokens, keys, kept)
    return written, reused, size


def _write_checkpoint(
    store: KVStore, what: tuple[str, list[int], int], contents: Callable, before: list[Point]
) -> tuple[Point, int]:
    """The checkpoint of `tokens` (`what`: the chunks' format, the tokens, the layer count),
    written from `contents()` (tensors, layout) unless saved already, its windows' rows
    before the end of the last of the conversation's checkpoints `before` left to that
    one (`window_rows.cut`, `checkpoint_chain.parent`); (it, bytes written: 0 when
    reused). One saved already whose chain `before` lacks (another chat's, or one whose
    checkpoint before was lost) is written again, whole."""
    fmt, tokens, layers = what
    key = checkpoint_key(store.fingerprint, fmt, tokens)
    row = store.index.chunk(key)
    if row is not None and not store.index.chunk_path(key).is_file():
        row = None  # a row whose file is gone: written again (`KVStore.have`)
    if row is not None:
        saved = Point.of(key, row)
        if checkpoint_chain.chain(saved, before) is not None:
            return saved, 0
        store.index.delete_chunk(key)
    tensors, layout = contents()
    parent = checkpoint_chain.parent(before) if row is None else None
    since = parent.end if parent else 0
    tensors, layout, needs_from = window_rows.cut(tensors, layout, since)
    needs_from = len(tokens) if needs_from is None else needs_from
    rows_from = since if needs_from < since else None
    manifest = ChunkManifest(
        store.fingerprint, SNAPSHOT, key, needs_from, len(tokens), tokens_hash(tokens), layers
    )
    size = store.write(manifest, tensors, {"layout": layout}, rows_from)
    return Point(key, len(tokens), needs_from, rows_from), size


def _earlier_checkpoints(
    store: KVStore, previous: ConversationCache | None, fmt: str, tokens: list[int]
) -> list[Point]:
    """The previous save's checkpoints, oldest first, that `tokens` still extend, whose
    chunks are in `fmt` (a changed KV preference leaves none) and whose files are there."""
    if previous is None:
        return []
    prefix_keys = _PrefixKeys(store.fingerprint, fmt, tokens)
    rows = store.index.chunks(previous.checkpoint_keys)
    kept = []
    for key in previous.checkpoint_keys:
        row = rows.get(key)
        if row is None or row["token_end"] >= len(tokens):
            continue
        if not store.index.chunk_path(key).is_file():
            continue
        if prefix_keys.get(row["token_end"]) == key:
            kept.append(Point.of(key, row))
    return kept


def bytes_to_read(store: KVStore, entry: ConversationCache, usable: int) -> int:
    """What restoring the first `usable` tokens of `entry` reads: its checkpoint, those
    before it that hold its windows' rows, and the chunks of the tokens before it."""
    try:
        picked = pick(store, entry, usable)
    except CacheRejected:
        return 0
    if picked is None:
        return 0
    _, _, row, chain = picked
    chunks = store.chunk_bytes(entry, row["token_end"]) if entry.chunk_keys else 0
    return sum(held["bytes"] for held in chain.values()) + chunks


def restore(store: KVStore, entry: ConversationCache, usable: int) -> tuple[list, int, int, int]:
    """The latest checkpoint within the first `usable` tokens, its windows' rows taken
    from those before it where it holds only its own, and its chunked layers put back
    in their places; (cache, its token count, bytes read, which checkpoint of the
    conversation's, from 1)."""
    picked = pick(store, entry, usable)
    if picked is None:
        raise CacheRejected("the conversation changed before its first checkpoint")
    number, key, row, chain = picked
    end = row["token_end"]
    template = make_prompt_cache(store.loaded.model)
    reader = _CheckpointReader(store, entry, len(template), chain)
    with closing(reader.ahead):
        try:
            host, layout = window_rows.fill(*reader.read(key, row), reader.ending_at)
        except CacheUnreadable:
            raise  # the system's error, not the files': kept for the next restore
        except CacheRejected:
            # Files that do not fit together: the next save must not build on them.
            store.index.drop_unshared(entry.conversation_id, {key, *reader.keys})
            raise
    shapes = store.loaded.attention_shapes
    cache, in_chunks = snapshots.restore_checkpoint(template, in_mlx(host), layout, shapes)
    size = reader.bytes
    if in_chunks:
        size += _put_chunked_layers(store, entry, end, cache, in_chunks)
    mx.eval([layer.state for layer in cache])
    return cache, end, size, number


class _CheckpointReader:
    """A restore's checkpoint files, each checked against its index row: the one picked
    and those before it that hold its windows' rows (the conversation's own only). Those
    of its chain (`pick`) are read and checked ahead on threads, into host memory (mlx's
    streams are a thread's own), while the rows of the later ones are taken apart: a
    chain of short turns is many small files."""

    def __init__(
        self, store: KVStore, entry: ConversationCache, layers: int, chain: dict[str, dict]
    ) -> None:
        self.store, self.entry, self.layers, self.rows = store, entry, layers, chain
        self.prefix_keys = _PrefixKeys(store.fingerprint, entry.kv_format, entry.tokens)
        self.keys: list[str] = []
        self.bytes = 0
        earlier = list(chain.items())[1:]
        self._expected = [key for key, _ in earlier]  # in the order `fill` asks for them
        self.ahead = read_in_threads(self._read_file, earlier, _READ_AHEAD)

    def _read_file(self, key: str, row: dict) -> tuple[dict, dict]:
        """A checkpoint's file, checked: its metadata must say what its row does."""
        end = row["token_end"]
        manifest = ChunkManifest(
            self.store.fingerprint,
            SNAPSHOT,
            key,
            row["token_start"],
            end,
            tokens_hash(self.entry.tokens[:end]),
            self.layers,
        )
        return read_file(path_from_url(row["url"], self.store.index.root), manifest.expected())

    def read(self, key: str, row: dict) -> tuple[dict, str]:
        try:
            if self._expected[:1] == [key]:
                self._expected.pop(0)
                tensors, metadata = next(self.ahead)
            else:
                tensors, metadata = self._read_file(key, row)
        except CacheUnreadable:
            raise  # the system's error, not the file's: kept for the next restore
        except CacheRejected:
            # gone or damaged (for every chat that lists it): so that the next save
            # holds its windows whole, not leaving the rows it lacks to this one
            self.store.index.delete_chunk(key)
            raise
        self.keys.append(key)
        self.bytes += row["bytes"]
        return tensors, metadata.get("layout", "")  # in host memory: `fill` joins them there

    def ending_at(self, end: int) -> tuple[dict, str]:
        """The conversation's checkpoint of its first `end` tokens."""
        key = self.prefix_keys.get(end) if 0 < end <= len(self.entry.tokens) else None
        row = None
        if key in self.entry.checkpoint_keys:
            row = self.rows.get(key) or self.store.index.chunk(key)
        if row is None or row["token_end"] != end:
            raise CacheRejected("a checkpoint before this one is missing")
        return self.read(key, row)


def _put_chunked_layers(
    store: KVStore, entry: ConversationCache, end: int, cache: list, in_chunks: dict[int, str]
) -> int:
    """Put the layers the checkpoint leaves to chunks, read for tokens [0, end), in
    their places in `cache`; the bytes read."""
    if entry.kv_format == SNAPSHOT or not entry.chunk_keys:
        raise CacheRejected("a checkpoint whose chunks were not saved")
    layers, restored, size = store.read_chunks(entry, end)
    if restored != end:
        raise CacheRejected("cache files were evicted")
    held = {slot: type(layer).__name__ for slot, layer in enumerate(layers) if layer is not None}
    if held != in_chunks:
        raise CacheRejected("the chunks and the checkpoint disagree on the layers")
    for slot in held:
        snapshots.put_part(cache, slot, layers[slot])
    return size


def pick(store: KVStore, entry: ConversationCache, usable: int) -> tuple | None:
    """(number from 1, key, row, its chain's rows by key, latest first:
    `checkpoint_chain.chain`) of the latest saved
    checkpoint that ends within the first `usable` tokens, before any evicted chunk,
    whose key is theirs and whose chain is all there; None when there is none,
    `CacheRejected` when the chunks' rows are damaged."""
    limit = min(usable, len(entry.tokens))
    if entry.chunk_keys:
        chunks = store.saved_chunks(entry)
        if not chunks:
            raise CacheRejected("cache files were evicted")
        limit = min(limit, chunks[-1][2])
    rows = store.index.chunks(entry.checkpoint_keys)
    points = [Point.of(key, rows[key]) for key in entry.checkpoint_keys if key in rows]
    prefix_keys = _PrefixKeys(store.fingerprint, entry.kv_format, entry.tokens)
    for number in range(len(entry.checkpoint_keys), 0, -1):
        key = entry.checkpoint_keys[number - 1]
        row = rows.get(key)
        if row is None or not 0 < row["token_end"] <= limit:
            continue  # evicted, or past the change
        found = checkpoint_chain.chain(Point.of(key, row), points)
        if found is not None and prefix_keys.get(row["token_end"]) == key:
            return number, key, row, {point.key: rows[point.key] for point in found}
    return None


class _PrefixKeys:
    """The checkpoint keys of prefixes of `tokens`, by length, computed when asked."""

    def __init__(self, fingerprint: str, fmt: str, tokens: list[int]) -> None:
        self.fingerprint, self.fmt, self.tokens, self._keys = fingerprint, fmt, tokens, {}

    def get(self, end: int) -> str:
        if end not in self._keys:
            self._keys[end] = checkpoint_key(self.fingerprint, self.fmt, self.tokens[:end])
        return self._keys[end]
