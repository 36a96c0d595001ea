"""Saving a conversation's KV cache as chunk files, and restoring it.

A conversation's cache is cut along the token axis into chunks of
`chunk_tokens`. A chunk's key hashes the model fingerprint, the KV format and
the whole token prefix up to the chunk's end, so equal prefixes (branches,
shared system prompts) share files, and a turn writes only chunks that do not
exist yet: its own new tokens plus the rewritten last partial chunk.

Restoring reads the chunks the new prompt can use, checks each against what
it must be (allow-listed cache classes, layer count, shapes, dtypes, token
hash, checksum), copies them into preallocated per-layer buffers and trims
to the shared prefix.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache, trim_prompt_cache

from app.engine import snapshots
from app.engine.chat import common_prefix_length
from app.engine.kvquant import MixedKVCache
from app.engine.kvscheme import KVScheme, parse_format
from app.engine.loading import LoadedModel
from app.engine.stored_arrays import check_dtype, from_stored, to_numpy
from sessions.cachefiles import (
    CacheIndex,
    CacheRejected,
    ConversationCache,
    path_from_url,
    read_file,
    write_file,
)

SNAPSHOT = "snapshot"
# The only cache classes ever built from a file (never a name looked up at large).
ALLOWED_CLASSES = {
    "KVCache": KVCache,
    "QuantizedKVCache": QuantizedKVCache,
    "MixedKVCache": MixedKVCache,
}
_PARTS = ("k", "v")


def model_fingerprint(model_dir: Path) -> str:
    """Identifies weights, tokenizer and chat template of a model folder.

    Config and tokenizer files are hashed whole; weight files by name, size
    and modification time (hashing gigabytes at every start would be slow;
    imported GGUF models also carry the GGUF's SHA-256 in config.json).
    """
    digest = hashlib.sha256()
    for name in (
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "chat_template.json",
    ):
        path = model_dir / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        stat = path.stat()
        digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:32]


def kv_format(cache: list) -> str | None:
    """ "float32", "float16", "q8g64" (mlx-lm's), "k4v4g64s4h" (ours), ...; None when
    layers differ or are not allow-listed."""
    formats = set()
    for layer in cache:
        if type(layer) is MixedKVCache and layer.max_size is None:
            formats.add(layer.scheme.format)
        elif type(layer) is QuantizedKVCache:
            formats.add(f"q{layer.bits}g{layer.group_size}")
        elif type(layer) is KVCache and layer.keys is not None:
            formats.add(str(layer.keys.dtype).split(".")[-1])
        else:
            return None
    return formats.pop() if len(formats) == 1 else None


def _tokens_hash(tokens: list[int]) -> str:
    return hashlib.sha256(np.asarray(tokens, dtype="<i4").tobytes()).hexdigest()


def chunk_keys(
    fingerprint: str, fmt: str, tokens: list[int], size: int
) -> list[tuple[str, int, int]]:
    """(key, start, end) of each chunk; the key chains over the whole prefix."""
    result = []
    prefix = hashlib.sha256(f"{fingerprint}|{fmt}".encode()).hexdigest()
    for start in range(0, len(tokens), size):
        end = min(start + size, len(tokens))
        prefix = hashlib.sha256((prefix + _tokens_hash(tokens[start:end])).encode()).hexdigest()
        result.append((prefix[:40], start, end))
    return result


def _chunk_tensors(cache: list, start: int, end: int) -> dict[str, np.ndarray]:
    """Tokens [start, end) of every layer, as the named arrays a chunk file holds."""
    tensors = {}
    for i, layer in enumerate(cache):
        if isinstance(layer, MixedKVCache):
            named = layer.quantized_tokens(start, end)
        else:
            named = {}
            for part, state in zip(_PARTS, (layer.keys, layer.values), strict=True):
                items = state if isinstance(state, tuple | list) else (state,)
                for n, array in enumerate(items):
                    named[f"{part}.{n}"] = array[..., start:end, :]
        tensors.update({f"{i}.{name}": to_numpy(array) for name, array in named.items()})
    return tensors


@dataclass
class SaveReport:
    chunks_written: int = 0
    chunks_reused: int = 0
    bytes_written: int = 0
    seconds: float = 0.0


@dataclass
class RestoreResult:
    cache: list | None
    tokens: list[int]
    seconds: float = 0.0
    bytes_read: int = 0
    rejected: str | None = None
    details: dict = field(default_factory=dict)


class KVStore:
    def __init__(self, index: CacheIndex, loaded: LoadedModel, chunk_tokens: int = 256) -> None:
        self.index = index
        self.loaded = loaded
        self.chunk_tokens = chunk_tokens
        self.fingerprint = model_fingerprint(loaded.path)

    # -- save ------------------------------------------------------------------

    def save(self, conversation_id: int, tokens: list[int], cache: list) -> SaveReport:
        started = time.perf_counter()
        report = SaveReport()
        if cache and tokens and not snapshots.is_chunkable(cache):
            return self._save_snapshot(conversation_id, tokens, cache, report, started)
        fmt = kv_format(cache) if cache else None
        if fmt is None or not tokens or cache[0].offset != len(tokens):
            self.index.forget_conversation(conversation_id)
            return report
        chunks = chunk_keys(self.fingerprint, fmt, tokens, self.chunk_tokens)
        classes = json.dumps([type(layer).__name__ for layer in cache])
        existing = []
        for key, start, end in chunks:
            row = self.index.chunk(key)
            if row and self.index.chunk_path(key).is_file():
                existing.append(key)
                report.chunks_reused += 1
                continue
            tensors = _chunk_tensors(cache, start, end)
            metadata = {
                "model": self.fingerprint,
                "kv_format": fmt,
                "key": key,
                "token_start": str(start),
                "token_end": str(end),
                "tokens_hash": _tokens_hash(tokens[start:end]),
                "layers": str(len(cache)),
                "classes": classes,
                "dtype": str(tensors["0.k.0"].dtype),
            }
            path = self.index.chunk_path(key)
            size = write_file(path, tensors, metadata)
            self.index.add_chunk(key, path, size, self.fingerprint, fmt, start, end)
            report.chunks_written += 1
            report.bytes_written += size
        self.index.touch(existing)
        self._point_conversation(
            conversation_id, fmt, tokens, self.chunk_tokens, [k for k, _, _ in chunks]
        )
        report.seconds = time.perf_counter() - started
        return report

    def _point_conversation(
        self, conversation_id: int, fmt: str, tokens: list[int], chunk_tokens: int, keys: list[str]
    ) -> None:
        previous = self.index.conversation(conversation_id)
        self.index.set_conversation(
            ConversationCache(
                conversation_id, self.fingerprint, fmt, list(tokens), chunk_tokens, keys
            )
        )
        if previous:  # typically the old partial last chunk, or the previous snapshot
            self.index.release(set(previous.chunk_keys) - set(keys))

    def _save_snapshot(
        self,
        conversation_id: int,
        tokens: list[int],
        cache: list,
        report: SaveReport,
        started: float,
    ) -> SaveReport:
        """Non-chunkable caches: the whole cache in one file (`chunk_tokens` 0 marks it)."""
        key = chunk_keys(self.fingerprint, SNAPSHOT, tokens, len(tokens))[0][0]
        if not (self.index.chunk(key) and self.index.chunk_path(key).is_file()):
            tensors, layout = snapshots.snapshot(cache)
            metadata = {
                "model": self.fingerprint,
                "kv_format": SNAPSHOT,
                "key": key,
                "token_start": "0",
                "token_end": str(len(tokens)),
                "tokens_hash": _tokens_hash(tokens),
                "layers": str(len(cache)),
                "layout": layout,
            }
            path = self.index.chunk_path(key)
            size = write_file(path, tensors, metadata)
            self.index.add_chunk(key, path, size, self.fingerprint, SNAPSHOT, 0, len(tokens))
            report.chunks_written, report.bytes_written = 1, size
        self._point_conversation(conversation_id, SNAPSHOT, tokens, 0, [key])
        report.seconds = time.perf_counter() - started
        return report

    # -- restore -----------------------------------------------------------------

    def plan(self, entry: ConversationCache, prompt: list[int]) -> tuple[int, int]:
        """(tokens usable, bytes to read) for restoring `entry` toward `prompt`."""
        if entry.kv_format == SNAPSHOT:
            row = self.index.chunk(entry.chunk_keys[0])
            return len(entry.tokens), row["bytes"] if row else 0
        usable = common_prefix_length(entry.tokens, prompt)
        usable = min(usable, len(prompt) - 1)
        size = 0
        for key, start, _ in chunk_keys(
            self.fingerprint, entry.kv_format, entry.tokens, entry.chunk_tokens
        ):
            if start >= usable:
                break
            row = self.index.chunk(key)
            size += row["bytes"] if row else 0
        return usable, size

    def restore(self, entry: ConversationCache, prompt: list[int]) -> RestoreResult:
        """Rebuild the cache for the prefix `prompt` shares with the saved tokens."""
        started = time.perf_counter()
        try:
            cache, restored, size = self._load(entry, prompt)
        except CacheRejected as exc:
            return RestoreResult(None, [], time.perf_counter() - started, rejected=exc.reason)
        return RestoreResult(cache, entry.tokens[:restored], time.perf_counter() - started, size)

    def _load(self, entry: ConversationCache, prompt: list[int]) -> tuple[list, int, int]:
        if entry.model_fingerprint != self.fingerprint:
            raise CacheRejected("saved for a different model")
        if entry.kv_format == SNAPSHOT:
            return self._load_snapshot(entry, prompt)
        usable = min(common_prefix_length(entry.tokens, prompt), len(prompt) - 1)
        if usable <= 0:
            raise CacheRejected("nothing in common with the conversation")
        chunks = chunk_keys(self.fingerprint, entry.kv_format, entry.tokens, entry.chunk_tokens)
        if [k for k, _, _ in chunks] != entry.chunk_keys:
            raise CacheRejected("index does not match its tokens")
        needed = [(k, s, e) for k, s, e in chunks if s < usable]
        template = make_prompt_cache(self.loaded.model)
        buffers: list[dict[str, list]] | None = None
        total = needed[-1][2]
        size = 0
        for key, start, end in needed:
            row = self.index.chunk(key)
            if row is None:
                if start == 0:
                    raise CacheRejected("cache files were evicted")
                total = start  # a later chunk was evicted: restore what precedes it
                break
            tensors, metadata = read_file(
                path_from_url(row["url"], self.index.root),
                {
                    "model": self.fingerprint,
                    "kv_format": entry.kv_format,
                    "key": key,
                    "token_start": str(start),
                    "token_end": str(end),
                    "tokens_hash": _tokens_hash(entry.tokens[start:end]),
                    "layers": str(len(template)),
                },
                load=_load_mlx,
            )
            classes = json.loads(metadata.get("classes", "[]"))
            self._check_classes(classes, template)
            if buffers is None:
                buffers = self._collectors(tensors, len(template))
            self._copy_in(buffers, tensors, metadata, start, end)
            size += row["bytes"]
        self.index.touch([k for k, _, _ in needed])
        cache = self._build(classes, buffers, entry.kv_format, total)
        restored = min(usable, total)
        if total > restored:
            trim_prompt_cache(cache, total - restored)
        return cache, restored, size

    def _load_snapshot(self, entry: ConversationCache, prompt: list[int]) -> tuple[list, int, int]:
        tokens = entry.tokens
        if len(prompt) <= len(tokens) or prompt[: len(tokens)] != tokens:
            raise CacheRejected("the conversation changed since its snapshot")
        key = entry.chunk_keys[0]
        if key != chunk_keys(self.fingerprint, SNAPSHOT, tokens, len(tokens))[0][0]:
            raise CacheRejected("index does not match its tokens")
        row = self.index.chunk(key)
        if row is None:
            raise CacheRejected("cache files were evicted")
        tensors, metadata = read_file(
            path_from_url(row["url"], self.index.root),
            {
                "model": self.fingerprint,
                "kv_format": SNAPSHOT,
                "key": key,
                "tokens_hash": _tokens_hash(tokens),
            },
            load=_load_mlx,
        )
        cache = snapshots.restore(
            make_prompt_cache(self.loaded.model), tensors, metadata.get("layout", "")
        )
        mx.eval([layer.state for layer in cache])
        self.index.touch([key])
        return cache, len(tokens), row["bytes"]

    def _check_classes(self, classes: list[str], template: list) -> None:
        if len(classes) != len(template):
            raise CacheRejected("layer count does not match the model")
        for name, layer in zip(classes, template, strict=True):
            if not isinstance(layer, KVCache):
                raise CacheRejected(f"this model's {type(layer).__name__} layers are not chunked")
            if name not in ALLOWED_CLASSES:
                raise CacheRejected(f"unknown cache class {name!r}")

    def _expected_shape(self, name: str, fmt: str, start: int, end: int) -> tuple[int, ...] | None:
        """The shape tensor `name` (of one layer) has in chunk [start, end) of a cache
        saved as `fmt`; None where the chunk has no such tensor."""
        heads = int(
            self.loaded.config.get("num_key_value_heads")
            or self.loaded.config["num_attention_heads"]
        )
        dim = self.loaded.head_dim
        part, _, n = name.partition(".")
        if fmt.startswith("k"):  # ours: see kvquant.MixedKVCache.quantized_tokens
            scheme = _scheme(fmt)
            if name in ("sk", "sv"):
                return (
                    (1, heads, min(scheme.sink, end), dim) if start == 0 and scheme.sink else None
                )
            bits = scheme.key_bits if part == "k" else scheme.value_bits
            group = scheme.group_size
        elif fmt.startswith("q"):
            bits, group = (int(x) for x in fmt[1:].split("g"))
        else:
            bits, group = None, dim
        widths = (
            {"0": dim}
            if bits is None
            else {"0": dim * bits // 32, "1": dim // group, "2": dim // group}
        )
        return (1, heads, end - start, widths[n]) if part in _PARTS and n in widths else None

    def _collectors(self, tensors, layers: int) -> list[dict[str, list]]:
        """Per layer and tensor, the list its chunks are collected in.

        Chunks are joined once at the end into one buffer of the final length: one
        allocation and one copy per byte. (mlx's slice assignment into a preallocated
        array copied the whole buffer per chunk, so time grew with the square of the
        length; fresh numpy buffers cost a page fault per 4 KiB on these machines.)
        """
        buffers = []
        for i in range(layers):
            named = {}
            for full_name, array in tensors.items():
                layer, name = full_name.split(".", 1)
                if int(layer) != i:
                    continue
                check_dtype(array.dtype, full_name)
                named[name] = []
            if not named:
                raise CacheRejected(f"layer {i} is missing from the file")
            buffers.append(named)
        return buffers

    def _copy_in(self, buffers, tensors, metadata, start: int, end: int) -> None:
        fmt = metadata["kv_format"]
        for i, named in enumerate(buffers):
            wanted = {n for n in named if self._expected_shape(n, fmt, start, end) is not None}
            present = {full.split(".", 1)[1] for full in tensors if full.split(".", 1)[0] == str(i)}
            if present != wanted:
                raise CacheRejected(f"layer {i} has the wrong tensors")
        if len(tensors) != sum(1 for full in tensors if full.split(".", 1)[0].isdigit()):
            raise CacheRejected("a tensor is not named by layer")
        for full_name, array in tensors.items():
            layer, name = full_name.split(".", 1)
            pieces = buffers[int(layer)].get(name)
            want = self._expected_shape(name, fmt, start, end)
            if pieces is None or tuple(array.shape) != want:
                raise CacheRejected(f"{full_name} has the wrong shape {tuple(array.shape)}")
            if pieces and array.dtype != pieces[0].dtype:
                raise CacheRejected(f"{full_name} has the wrong dtype {array.dtype}")
            pieces.append(array)

    def _build(self, classes: list[str], buffers, fmt: str, total: int) -> list:
        cache = []
        for name, host in zip(classes, buffers, strict=True):
            named = {
                key: mx.concatenate([from_stored(piece) for piece in pieces], axis=2)
                for key, pieces in host.items()
            }
            family = {"MixedKVCache": "k", "QuantizedKVCache": "q"}.get(name, "float")
            if not fmt.startswith(family):
                raise CacheRejected(f"{name} layers in a {fmt} cache")
            if name == "MixedKVCache":
                layer = MixedKVCache.from_quantized(_scheme(fmt), named)
                if layer.stored() != total:
                    raise CacheRejected("restored length does not match")
                cache.append(layer)
                continue
            if name == "QuantizedKVCache":
                bits, group = (int(x) for x in fmt[1:].split("g"))
                layer = QuantizedKVCache(group_size=group, bits=bits)
                layer.keys = tuple(named[f"k.{n}"] for n in range(3))
                layer.values = tuple(named[f"v.{n}"] for n in range(3))
            else:
                layer = KVCache()
                layer.keys, layer.values = named["k.0"], named["v.0"]
            layer.offset = total
            if named["k.0"].shape[2] != total:
                raise CacheRejected("restored length does not match")
            cache.append(layer)
        mx.eval([layer.state for layer in cache])
        return cache


def _scheme(fmt: str) -> KVScheme:
    try:
        return parse_format(fmt)
    except ValueError as exc:
        raise CacheRejected(f"unknown KV format {fmt!r}") from exc


def _load_mlx(path: Path) -> tuple[dict[str, mx.array], dict[str, str]]:
    """Read a chunk file straight into mlx memory (cheaper here than fresh numpy buffers)."""
    tensors, metadata = mx.load(str(path), return_metadata=True)
    mx.eval(list(tensors.values()))
    return tensors, metadata
