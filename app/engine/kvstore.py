"""Saving a conversation's KV cache as chunk files, and restoring it.

A conversation's cache is cut along the token axis into chunks of at most
`chunk_tokens`. A chunk's key hashes the model fingerprint, the KV format and
the whole token prefix up to the chunk's end, so equal prefixes (branches,
shared system prompts) share files. A save keeps the conversation's chunks that
its tokens still begin with and writes only the tokens after them: a turn
appends its own tokens (cut at multiples of `chunk_tokens`, `grid_ends`), it
never rewrites a chunk. Each chunk's row holds its span; the keys, recomputed
over those spans, must match. A cache with layers that cannot be cut along the
token axis (sliding windows, recurrent state) keeps its other layers in such
chunks and the rest in a checkpoint per turn (`app.engine.checkpoints`).

Restoring reads the chunks a prompt can use, has each checked by its layers'
codecs (app.engine.codecs), joins them once (app.engine.chunkjoin) and trims to
the usable prefix. Where the GPU has memory of its own, threads read and check
the next files while the last one is copied to the device (`_read_files`). A
restore raced against recomputing (app/engine/restore_race.py) takes the same
steps (`chunk_reads`, `on_device`, `join`), its files read on threads of its own.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import closing
from dataclasses import dataclass

from app.engine import checkpoints, recent_copies, snapshots
from app.engine.cache_keys import (
    cache_parts,
    chain_keys,
    grid_ends,
    kv_format,
    model_fingerprint,
    tokens_hash,
)
from app.engine.chunkjoin import ChunkJoin
from app.engine.codecs import (
    ChunkManifest,
    LayerShape,
    chunk_classes,
    chunk_tensors,
    is_window_copy,
    read_classes,
    sixteen_bit_type,
    stored_dtype,
    stored_format,
)
from app.engine.host_read import ChunkReads
from app.engine.kvquant import MixedKVCache
from app.engine.loading import LoadedModel
from app.engine.stored_arrays import device_apart, read_in_threads, to_device
from sessions.cachefiles import (
    CacheIndex,
    CacheRejected,
    ConversationCache,
    paths_from_urls,
    read_ahead,
    read_file,
    write_file,
)

# Chunk files read at once ahead of the one being copied to the GPU: a few reads in
# flight keep a fast disk busy; each holds one chunk in host memory (~30 MB at 256
# tokens of an 8B model).
READ_AHEAD = 4


@dataclass(frozen=True)
class SaveReport:
    chunks_written: int = 0
    chunks_reused: int = 0
    bytes_written: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class RestoreResult:
    cache: list | None
    tokens: list[int]
    seconds: float = 0.0
    bytes_read: int = 0
    rejected: str | None = None
    checkpoint: int | None = None  # which snapshot of the conversation's, from 1
    copy_s: float = 0.0  # of `seconds`, the copies to a GPU's own memory (0: none)


class KVStore:
    def __init__(self, index: CacheIndex, loaded: LoadedModel, chunk_tokens: int = 256) -> None:
        self.index = index
        self.loaded = loaded
        self.chunk_tokens = chunk_tokens
        self.fingerprint = model_fingerprint(loaded.path)
        self.sixteen_bit = sixteen_bit_type(loaded.path)
        self.copy_seconds = 0.0  # the copies to the device of the restore under way
        # Found once per loaded model, when the engine starts, not in a restore.
        self._shapes: list[LayerShape | None] = loaded.cache_layer_shapes

    # -- save ------------------------------------------------------------------

    def save(
        self,
        conversation_id: int,
        tokens: list[int],
        cache: list,
        taken: checkpoints.Taken | None = None,
    ) -> SaveReport:
        """Write what the files lack of `cache` (holding `tokens`); `taken`: a checkpoint
        taken during the turn (`checkpoints.take`, app/engine/prompt_checkpoints.py)."""
        started = time.perf_counter()
        if cache and tokens and not snapshots.is_chunkable(cache):
            counts = checkpoints.save(self, conversation_id, tokens, cache, taken)
            return SaveReport(*counts, time.perf_counter() - started)
        live = kv_format(cache) if cache else None
        if live is None or not tokens or cache[0].offset != len(tokens):
            self.index.forget_conversation(conversation_id)
            return SaveReport()
        fmt = stored_format(live, self.sixteen_bit)
        previous = self.index.conversation(conversation_id)
        keys, written, reused, size = self.write_chunks(
            conversation_id, previous, fmt, tokens, cache
        )
        self.point_conversation(conversation_id, fmt, tokens, keys)
        return SaveReport(written, reused, size, time.perf_counter() - started)

    def take_checkpoint(self, cache: list, tokens: int) -> checkpoints.Taken:
        """A checkpoint of `cache` as it is now, at `tokens`, for a later `save`."""
        return checkpoints.take(self, cache, tokens)

    def resume(self, cache: list, taken: checkpoints.Taken) -> list:
        """The live `cache` back at a checkpoint taken from it (`checkpoints.resume`)."""
        return checkpoints.resume(self, cache, taken)

    def write_chunks(
        self,
        conversation_id: int,
        previous: ConversationCache | None,
        fmt: str,
        tokens: list[int],
        cache: list,
    ) -> tuple[list[str], int, int, int]:
        """The chunks of `cache`'s layers that chunks hold (`chunk_classes`), in `fmt`:
        those of the conversation's `previous` save that `tokens` still begin with
        are kept, the tokens after them written, and the 16-bit copies of recent rows
        looked after (`recent_copies`). (keys in order, chunks written, chunks
        reused, bytes)."""
        ends = self._chunk_ends(previous, fmt, tokens)
        chunks = chain_keys(self.fingerprint, fmt, tokens, ends)
        kept = {key for key, _, _ in chunks if self.have(key)}
        dequantized = any(
            isinstance(layer, MixedKVCache) and layer.tail_is_dequantized()
            for layer in cache_parts(cache)
        )
        copies = recent_copies.plan(self, conversation_id, previous, fmt, chunks, kept, dequantized)
        if copies.whole_tail:
            kept.discard(chunks[-1][0])  # written again, with the whole tail
        classes = chunk_classes(cache)

        def manifest(key: str, start: int, end: int) -> ChunkManifest:
            part = tokens_hash(tokens[start:end])
            return ChunkManifest(
                self.fingerprint, fmt, key, start, end, part, len(classes), classes
            )

        written = size = 0
        for key, start, end in chunks:
            if key not in kept:
                tensors = chunk_tensors(cache, start, end, stored_dtype(fmt), copies.whole_tail)
                size += self._write_anew(manifest(key, start, end), tensors)
                written += 1
        rewritten = 0
        for chunk in copies.passed:
            tensors = self._without_copies(manifest(*chunk))
            if tensors is not None:
                size += self._write_anew(manifest(*chunk), tensors)
                rewritten += 1
        keys = [k for k, _, _ in chunks]
        # One stamp for every chunk of the chat, written now or before: eviction takes
        # files used together from their end (`CacheIndex.evict_to_budget`).
        self.index.touch(keys)
        return keys, written + rewritten, len(kept) - rewritten, size

    def _write_anew(self, manifest: ChunkManifest, tensors: dict) -> int:
        """`write`, where a chunk under the key is dropped first (written again: with the
        whole tail, or without its copy). Its row and file go first, as any chunk's
        do: a crash before the new file has its row leaves an orphan for gc, never a
        row of the old size."""
        if self.index.chunk(manifest.key) is not None:
            self.index.delete_chunk(manifest.key)
        return self.write(manifest, tensors)

    def _without_copies(self, manifest: ChunkManifest) -> dict | None:
        """The chunk's tensors as its file holds them, less its 16-bit copy of recent
        rows: the file's own bytes, so that what other chats share under its key stays
        exactly what it was. None when it cannot be read (`read_chunk` then dropped it)."""
        try:
            tensors, _, _ = self.index.read_chunk(manifest.key, manifest.expected())
        except CacheRejected:
            return None
        return {name: array for name, array in tensors.items() if not is_window_copy(name)}

    def _chunk_ends(
        self, entry: ConversationCache | None, fmt: str, tokens: list[int]
    ) -> list[int]:
        """Where this save's chunks end: the chunks of the conversation's saved `entry`
        that `tokens` still begin with stay as they are, and new chunks hold the tokens
        after them."""
        kept: list[int] = []
        ours = (self.fingerprint, fmt)
        if entry and entry.chunk_tokens and (entry.model_fingerprint, entry.kv_format) == ours:
            same = _common_prefix(entry.tokens, tokens)
            try:
                kept = [end for _, _, end in self.saved_chunks(entry) if end <= same]
            except CacheRejected:
                kept = []  # a damaged index: write everything again
        start = kept[-1] if kept else 0
        return kept + grid_ends(start, len(tokens), self.chunk_tokens)

    def saved_chunks(self, entry: ConversationCache) -> list[tuple[str, int, int]]:
        """(key, start, end) of the entry's chunks that are on the index, in order, up
        to the first evicted one; `CacheRejected` when their rows and the entry's
        tokens disagree (each key is recomputed over the spans its rows give)."""
        return [(key, start, end) for key, start, end, _ in self._saved_rows(entry)]

    def _saved_rows(self, entry: ConversationCache) -> list[tuple[str, int, int, dict]]:
        """`saved_chunks`, each with its index row (read once: a restore needs the rows'
        paths and sizes too)."""
        rows: list[dict] = []
        found = self.index.chunks(entry.chunk_keys)
        for key in entry.chunk_keys:
            row = found.get(key)
            if row is None:
                break
            start, end = row["token_start"], row["token_end"]
            if start != (rows[-1]["token_end"] if rows else 0) or end <= start:
                raise CacheRejected("chunk spans do not follow each other")
            rows.append(row)
        ends = [row["token_end"] for row in rows]
        whole = len(ends) == len(entry.chunk_keys)
        if ends and (ends[-1] > len(entry.tokens) or (whole and ends[-1] != len(entry.tokens))):
            raise CacheRejected("chunk spans do not match the tokens")
        chunks = chain_keys(self.fingerprint, entry.kv_format, entry.tokens, ends)
        if [k for k, _, _ in chunks] != entry.chunk_keys[: len(chunks)]:
            raise CacheRejected("index does not match its tokens")
        return [(*chunk, row) for chunk, row in zip(chunks, rows, strict=True)]

    def have(self, key: str) -> bool:
        return self.index.chunk(key) is not None and self.index.chunk_path(key).is_file()

    def write(
        self,
        manifest: ChunkManifest,
        tensors: dict,
        extra: dict | None = None,
        rows_from: int | None = None,
    ) -> int:
        """The file first, then its index row (a crash between leaves an orphan file);
        `rows_from`: a checkpoint's, `CacheIndex.add_chunk`."""
        path = self.index.chunk_path(manifest.key)
        size = write_file(path, tensors, {**manifest.to_metadata(), **(extra or {})})
        span = (manifest.token_start, manifest.token_end, rows_from)
        self.index.add_chunk(manifest.key, path, size, self.fingerprint, manifest.kv_format, *span)
        return size

    def point_conversation(
        self,
        conversation_id: int,
        fmt: str,
        tokens: list[int],
        keys: list[str],
        checkpoint_keys: list[str] = (),
    ) -> None:
        """The conversation's cache is now these chunks and checkpoints; the files of its
        previous save that nobody uses any more go (typically the old partial last
        chunk, or a checkpoint of a branch left behind)."""
        previous = self.index.conversation(conversation_id)
        entry = ConversationCache(
            conversation_id,
            self.fingerprint,
            fmt,
            list(tokens),
            self.chunk_tokens if keys else 0,
            keys,
            checkpoint_keys=list(checkpoint_keys),
        )
        self.index.set_conversation(entry)
        if previous:
            self.index.release(set(previous.all_keys) - set(entry.all_keys))

    # -- restore -----------------------------------------------------------------

    def bytes_to_read(self, entry: ConversationCache, usable: int) -> int:
        """What restoring the first `usable` tokens of `entry` reads from disk."""
        if entry.checkpoint_keys:
            return checkpoints.bytes_to_read(self, entry, usable)
        return self.chunk_bytes(entry, usable)

    def chunk_bytes(self, entry: ConversationCache, usable: int) -> int:
        """The bytes of the chunks that hold the first `usable` tokens of `entry`."""
        try:
            chunks = self._saved_rows(entry)
        except CacheRejected:
            return 0
        return sum(row["bytes"] for _, start, _, row in chunks if start < usable)

    def restore(self, entry: ConversationCache, usable: int) -> RestoreResult:
        """Rebuild the cache of the first `usable` saved tokens (see steps.reusable_prefix).
        The files read are not stamped as used here (a write, an fsync, before the first
        token would delay it): the caller stamps them, a turn after its reply
        (`ConversationEngine._stamp_restored`, or its save), a prefetch at once."""
        started, self.copy_seconds = time.perf_counter(), 0.0
        try:
            self.check_model(entry)
            checkpoint = None
            if entry.checkpoint_keys:
                cache, restored, size, checkpoint = checkpoints.restore(self, entry, usable)
            else:
                cache, restored, size = self._load_chunks(entry, usable)
        except CacheRejected as exc:
            return RestoreResult(None, [], time.perf_counter() - started, rejected=exc.reason)
        seconds = time.perf_counter() - started
        tokens = entry.tokens[:restored]
        return RestoreResult(cache, tokens, seconds, size, None, checkpoint, self.copy_seconds)

    @property
    def chunked(self) -> bool:
        """Whether every layer of this model's cache is saved in chunks (none in a
        checkpoint: sliding windows, recurrent state)."""
        return None not in self._shapes

    def check_model(self, entry: ConversationCache) -> None:
        if entry.model_fingerprint != self.fingerprint:
            raise CacheRejected("saved for a different model")

    def _load_chunks(self, entry: ConversationCache, usable: int) -> tuple[list, int, int]:
        if usable <= 0:
            raise CacheRejected("nothing in common with the conversation")
        if None in self._shapes:
            raise CacheRejected("this model's cache layers are not chunked")
        cache, restored, size = self.read_chunks(entry, usable)
        if None in cache:
            raise CacheRejected("the chunks do not hold every layer")
        return cache, restored, size

    def read_chunks(self, entry: ConversationCache, usable: int) -> tuple[list, int, int]:
        """The layers `entry`'s chunks hold (None where they hold none) for its first
        `usable` tokens, or fewer where a chunk was evicted; (layers, their token
        count, bytes read). Each chunk is checked by its layers' codecs."""
        reads = self.chunk_reads(entry, usable)
        with closing(self._read_files(reads.paths, reads.expected)) as files:
            return self.join(reads, files, usable)

    def chunk_reads(self, entry: ConversationCache, usable: int) -> ChunkReads:
        """The chunks a restore of `entry`'s first `usable` tokens reads (from the
        index: the main thread's), and what each file must say of itself."""
        chunks = [chunk for chunk in self._saved_rows(entry) if chunk[1] < usable]
        paths = paths_from_urls([row["url"] for *_, row in chunks], self.index.root)
        expected = []
        for key, start, end, _ in chunks:
            part = tokens_hash(entry.tokens[start:end])
            manifest = ChunkManifest(
                self.fingerprint, entry.kv_format, key, start, end, part, len(self._shapes)
            )
            expected.append(manifest.expected())
        return ChunkReads(entry.kv_format, chunks, paths, expected)

    def join(
        self, reads: ChunkReads, files: Iterable[tuple[dict, dict]], usable: int
    ) -> tuple[list, int, int]:
        """The chunks' layers from their files' (tensors, metadata), in order."""
        chunks = reads.chunks
        join = ChunkJoin(self._shapes, reads.kv_format, chunks[-1][2] if chunks else 0)
        total, size = 0, 0
        for (_, start, end, row), (tensors, metadata) in zip(chunks, files, strict=True):
            join.add(tensors, read_classes(metadata, len(self._shapes)), (start, end))
            total, size = end, size + row["bytes"]
        if not total:
            raise CacheRejected("cache files were evicted")
        return join.build(total - min(usable, total)), min(usable, total), size

    def _read_files(self, paths: list, expected: list[dict]) -> Iterator[tuple[dict, dict]]:
        """Each chunk file's (tensors, metadata), checked, in order. Where the GPU has
        memory of its own, threads read and check the next files in host memory while
        the last one is copied to the device (`to_device`), so that reading the disk,
        checksums and copies overlap; elsewhere each file is read into host memory
        while the disk reads on ahead (`read_ahead`), and the join copies its tensors
        into the layers' buffers (`chunkjoin`)."""
        if not device_apart():
            read_ahead(paths)
            for path, wanted in zip(paths, expected, strict=True):
                yield read_file(path, wanted)
            return
        calls = list(zip(paths, expected, strict=True))
        yield from self.on_device(read_in_threads(read_file, calls, READ_AHEAD))

    def on_device(self, files: Iterable[tuple[dict, dict]]) -> Iterator[tuple[dict, dict]]:
        """Files read into host memory, their tensors copied to the device where it has
        memory of its own (elsewhere the join copies them into the layers' buffers);
        the copies' time is added up (`copy_seconds`) for the planner."""
        if not device_apart():
            yield from files
            return
        for tensors, metadata in files:
            started = time.perf_counter()
            on_device = to_device(tensors)
            self.copy_seconds += time.perf_counter() - started
            yield on_device, metadata


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens `a` and `b` begin with in common."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))
