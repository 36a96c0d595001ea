"""How each kind of chunkable cache layer is written to and rebuilt from chunk
files: one codec per cache class, and the manifest every chunk file carries.

A codec names the tensors of a layer's tokens [start, end), says which tensors
(with which shapes and dtypes) a chunk of a given format must hold, and builds
layers back from their chunks, in token order, a run of alike layers at once
(chunk files stack them: app/engine/layer_runs.py). Every check of a chunk's
contents is in `check_run`, so nothing unchecked reaches mlx.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from app.engine.cache_keys import cache_parts
from app.engine.kvquant import MixedKVCache
from app.engine.kvscheme import KVScheme, parse_format
from app.engine.kvwindow import copy_span, tail_rows_at, tail_start_at
from app.engine.layer_runs import Run, label, stack_runs
from app.engine.stored_arrays import stored_type, to_numpy
from app.engine.tokenstore import STEP, as_dtype
from sessions.cachefiles import CacheRejected

_MAX_WEIGHTS_HEADER = 64 * 1024 * 1024  # a model file's safetensors header, at most
_SIXTEEN_STORED = (mx.float16, mx.uint16)  # bfloat16 is stored as its raw 16 bits
_FLOAT_STORED = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.uint16}


@dataclass(frozen=True)
class LayerShape:
    """What one attention layer caches per token: heads, and key and value widths
    (they differ in MLA models), and the type the model computes them in."""

    heads: int
    key_dim: int
    value_dim: int
    dtype: mx.Dtype | None = None


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtypes: tuple[mx.Dtype, ...]
    optional: bool = False  # a chunk may hold it or not

    @property
    def choice(self) -> bool:
        """Whether its type is one of several (16 bits: float16, or bfloat16 as uint16)."""
        return len(self.dtypes) > 1


def attention_shapes(model) -> list[tuple[type, LayerShape | None]]:
    """Per layer (a CacheList's parts each in its place, `cache_parts`), its cache class
    and its shape as the model really caches it, from one token fed into a fresh cache
    (config fields differ between families; the model does not); None for a layer
    that holds no keys (a recurrent state)."""
    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    shapes = []
    for layer in cache_parts(cache):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if isinstance(keys, mx.array) and isinstance(values, mx.array):
            shape = LayerShape(keys.shape[1], keys.shape[3], values.shape[3], keys.dtype)
            shapes.append((type(layer), shape))
        else:
            shapes.append((type(layer), None))
    return shapes


class PlainCodec:
    """mlx-lm's `KVCache`, in the model's precision (the KV preference Off)."""

    name = "KVCache"

    def tensors(
        self, layer: KVCache, start: int, end: int, store_as: mx.Dtype | None = None
    ) -> dict[str, mx.array]:
        """Tokens [start, end); `store_as`: the 16-bit type a float32 compute path saves in."""
        keys, values = layer.keys[..., start:end, :], layer.values[..., start:end, :]
        if store_as is not None and keys.dtype != store_as:
            keys, values = keys.astype(store_as), values.astype(store_as)
        return {"k.0": keys, "v.0": values}

    def specs(
        self, shape: LayerShape, fmt: str, start: int, end: int, names: frozenset = frozenset()
    ) -> dict[str, TensorSpec]:
        if fmt not in _FLOAT_STORED:
            raise CacheRejected(f"a {self.name} layer in a {fmt} cache")
        dtypes = (_FLOAT_STORED[fmt],)
        n = end - start
        return {
            "k.0": TensorSpec((1, shape.heads, n, shape.key_dim), dtypes),
            "v.0": TensorSpec((1, shape.heads, n, shape.value_dim), dtypes),
        }

    def joins(self, name: str) -> bool:
        """Whether every chunk holds tensor `name`, joined along the tokens to build."""
        return True

    def capacity(self, count: int) -> int:
        """Tokens a built layer has room for: past `count` up to the next step, as
        `KVCache` grows (no copy of the cache when the first new token arrives; a
        buffer of the exact length would be regrown)."""
        return (count // KVCache.step + 1) * KVCache.step

    def build(
        self, joined: dict[str, list], count: int, fmt: str, compute: mx.Dtype | None = None
    ) -> list[KVCache]:
        """A run's layers from its tensors joined over the chunks (`joins`: an array per
        layer, room for `capacity(count)` tokens); in the `compute` type when it differs
        from the stored one (a 16-bit cache of an earlier version restored on the
        float32 CPU path), converted layer by layer, each conversion small enough to
        stay in the CPU's cache."""
        keys, values = joined["k.0"], joined["v.0"]
        dtype = compute or keys[0].dtype
        layers = []
        for row_keys, row_values in zip(keys, values, strict=True):
            layer = KVCache()
            layer.keys, layer.values = as_dtype(row_keys, dtype), as_dtype(row_values, dtype)
            layer.offset = count
            layers.append(layer)
        return layers

    def arrays(self, layer: KVCache) -> list[mx.array]:
        """What a built layer holds, to evaluate."""
        return [layer.keys, layer.values]


class MixedCodec:
    """The app's quantized `MixedKVCache`: every token quantized, plus the 16-bit
    sink in the first chunk and the 16-bit recent rows in the last one (see
    `MixedKVCache.quantized_tokens`)."""

    name = "MixedKVCache"

    def tensors(
        self, layer: MixedKVCache, start: int, end: int, whole_tail: bool = False
    ) -> dict[str, mx.array]:
        return layer.quantized_tokens(start, end, whole_tail)

    def specs(
        self, shape: LayerShape, fmt: str, start: int, end: int, names: frozenset = frozenset()
    ) -> dict[str, TensorSpec]:
        """What a chunk of tokens [start, end) holds; of the 16-bit copies of its recent
        rows, those among `names` (the tensors it holds) that fit: "r<first>-<end>k",
        at most the rows a layer holds in 16 bits at `end` (`tail_start_at`)."""
        scheme = scheme_of(fmt)
        n = end - start
        specs = {}
        for part, bits, dim in (
            ("k", scheme.key_bits, shape.key_dim),
            ("v", scheme.value_bits, shape.value_dim),
        ):
            if bits and (dim % scheme.group_size or dim * bits % 32):  # float16 has no groups
                raise CacheRejected(f"group size {scheme.group_size} does not fit width {dim}")
            if bits is None:
                specs[f"{part}.0"] = TensorSpec((1, shape.heads, n, dim), _SIXTEEN_STORED)
            else:
                groups = dim // scheme.group_size
                specs[f"{part}.0"] = TensorSpec((1, shape.heads, n, dim * bits // 32), (mx.uint32,))
                specs[f"{part}.1"] = TensorSpec((1, shape.heads, n, groups), _SIXTEEN_STORED)
                specs[f"{part}.2"] = TensorSpec((1, shape.heads, n, groups), _SIXTEEN_STORED)
            if start == 0 and scheme.sink:
                sink = min(scheme.sink, end)
                specs[f"s{part}"] = TensorSpec((1, shape.heads, sink, dim), _SIXTEEN_STORED)
            tail = tail_rows_at(end, scheme)
            if tail:  # format 4's last chunk of a cache: its 16-bit rows after the sink
                shape_16 = (1, shape.heads, tail, dim)
                specs[f"t{end}{part}"] = TensorSpec(shape_16, _SIXTEEN_STORED, optional=True)
        for name in names:
            span = copy_span(name, scheme)
            if span and name[0] == "r" and tail_start_at(end, scheme) <= span[0] < span[1] == end:
                dim = shape.key_dim if span[2] == "k" else shape.value_dim
                copy = (1, shape.heads, end - span[0], dim)
                specs[name] = TensorSpec(copy, _SIXTEEN_STORED, optional=True)
        return specs

    def joins(self, name: str) -> bool:
        """Whether every chunk holds tensor `name` ("k.0", "v.2": codes, scales, biases
        or float16 rows), joined along the tokens to build; the 16-bit sink ("sk") and
        recent rows ("t<end>k") are one chunk's each."""
        return name[1:2] == "."

    def capacity(self, count: int) -> int:
        """Tokens a built layer has room for: past `count` up to the next step."""
        return (count // STEP + 1) * STEP

    def build(
        self,
        joined: dict[str, list | mx.array],
        count: int,
        fmt: str,
        compute: mx.Dtype | None = None,
    ) -> list[MixedKVCache]:
        """A run's layers from its tensors (their types come from the scheme, not
        `compute`): each quantized tensor joined over the chunks (`joins`: an array per
        layer, with room for the tokens after them), the 16-bit sink the first chunk's
        and the recent rows the last one's (layers first)."""
        return MixedKVCache.from_quantized(scheme_of(fmt), joined, count)

    def arrays(self, layer: MixedKVCache) -> list[mx.array]:
        """What a built layer holds, to evaluate."""
        return [buffer for store in (*layer.bulk, *layer.exact) for buffer in store.buffers]


CODECS = {codec.name: codec for codec in (PlainCodec(), MixedCodec())}


def is_window_copy(name: str) -> bool:
    """Whether a chunk file's tensor ("<first>-<last>.<tensor>", or "<layer>.<tensor>"
    in format 3) is a 16-bit copy of recent rows (`MixedCodec`'s "r<first>-<end>k", or
    format 4's "t<end>k" of a save's last chunk)."""
    return name.split(".", 1)[-1][:1] in ("r", "t")


def stored_format(live: str, sixteen_bit: str | None) -> str:
    """The format a plain cache is saved in: a float32 cache of a 16-bit model (the CPU
    path computes in float32) is saved in the model's own 16-bit type, half the bytes;
    restoring converts it back. A float32 model's cache stays float32."""
    if live == "float32" and sixteen_bit in ("float16", "bfloat16"):
        return sixteen_bit
    return live


def sixteen_bit_type(model_dir: Path) -> str | None:
    """The model's own 16-bit type ("float16" or "bfloat16", the most common among its
    stored 16-bit weights, scales included), from the safetensors headers alone; None for
    a model stored without 16-bit floats."""
    counts = {"F16": 0, "BF16": 0}
    for path in sorted(model_dir.glob("*.safetensors")):
        try:
            with open(path, "rb") as f:
                length = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(min(length, _MAX_WEIGHTS_HEADER)))
        except (OSError, ValueError):
            continue
        for entry in header.values() if isinstance(header, dict) else ():
            dtype = entry.get("dtype") if isinstance(entry, dict) else None
            if dtype in counts:
                counts[dtype] += 1
    if not any(counts.values()):
        return None
    return "float16" if counts["F16"] >= counts["BF16"] else "bfloat16"


def stored_dtype(fmt: str) -> mx.Dtype | None:
    """The mlx type of a plain format's tokens ("bfloat16" -> mx.bfloat16); None if not plain."""
    return {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}.get(fmt)


def codec_for(layer) -> PlainCodec | MixedCodec | None:
    codec = CODECS.get(type(layer).__name__)
    if codec is None or getattr(layer, "max_size", None) is not None:
        return None
    return codec


def scheme_of(fmt: str) -> KVScheme:
    try:
        return parse_format(fmt)
    except ValueError as exc:
        raise CacheRejected(f"unknown KV format {fmt!r}") from exc


def chunk_classes(cache: list) -> tuple[str | None, ...]:
    """Per layer (`cache_parts`), the class a chunk file holds it as; None for a layer
    chunks cannot hold (a checkpoint does)."""
    return tuple(type(part).__name__ if codec_for(part) else None for part in cache_parts(cache))


def chunk_tensors(
    cache: list, start: int, end: int, store_as: mx.Dtype | None = None, whole_tail: bool = False
) -> dict:
    """Tokens [start, end) of every layer a chunk holds (`chunk_classes`), with layers
    counted as `cache_parts` does and alike neighbours stacked (`stack_runs`), for a
    chunk file (`store_as`: the type plain layers are saved in, see `stored_format`;
    `whole_tail`: the save's last chunk holds the 16-bit copy of the whole tail,
    app/engine/recent_copies.py)."""
    layers = []
    for i, layer in enumerate(cache_parts(cache)):
        codec = codec_for(layer)
        if codec is None:
            continue
        if isinstance(codec, PlainCodec):
            named = codec.tensors(layer, start, end, store_as)
        else:
            named = codec.tensors(layer, start, end, whole_tail)
        layers.append((i, codec.name, {name: to_numpy(a) for name, a in named.items()}))
    return stack_runs(layers)


def check_run(run: Run, named: dict, specs: dict[str, TensorSpec], previous: dict) -> None:
    """A run of alike layers of a chunk holds exactly the tensors `specs` names for
    one of them, stacked (the layers first), with the dtypes of the chunk before it."""
    required = {name for name, spec in specs.items() if not spec.optional}
    if not required <= set(named) <= set(specs):
        raise CacheRejected(f"{label(run)} has the wrong tensors")
    layers = run[1] - run[0] + 1
    # A run's 16-bit tensors (rows, scales, sink, recent rows) are of one type, as a
    # save writes them; each name also keeps its type from chunk to chunk, so the
    # tensors of one chunk only (the sink, the recent rows) agree with all the others.
    if len({stored_type(a) for n, a in named.items() if n in specs and specs[n].choice}) > 1:
        raise CacheRejected(f"{label(run)}: its 16-bit tensors are of different types")
    for name, array in named.items():
        spec = specs[name]
        if tuple(array.shape) != (layers, *spec.shape):
            raise CacheRejected(f"{label(run)}: {name} has the wrong shape {tuple(array.shape)}")
        dtype = stored_type(array)
        if dtype not in spec.dtypes or (name in previous and stored_type(previous[name]) != dtype):
            raise CacheRejected(f"{label(run)}: {name} has the wrong dtype {array.dtype}")


@dataclass(frozen=True)
class ChunkManifest:
    """The metadata a chunk (or snapshot) file carries, and must match to be used."""

    model: str
    kv_format: str
    key: str
    token_start: int
    token_end: int
    tokens_hash: str
    layers: int
    classes: tuple[str, ...] = ()

    def to_metadata(self) -> dict[str, str]:
        metadata = self.expected()
        if self.classes:
            metadata["classes"] = json.dumps(list(self.classes))
        return metadata

    def expected(self) -> dict[str, str]:
        """What a file's metadata must say, exactly, to be this chunk."""
        return {
            "model": self.model,
            "kv_format": self.kv_format,
            "key": self.key,
            "token_start": str(self.token_start),
            "token_end": str(self.token_end),
            "tokens_hash": self.tokens_hash,
            "layers": str(self.layers),
        }


def read_classes(metadata: dict[str, str], layers: int) -> list[str | None]:
    """The cache class of every layer a chunk names, None for one it does not hold
    (`chunk_classes`); only codecs' classes pass."""
    try:
        classes = json.loads(metadata.get("classes", ""))
    except ValueError as exc:
        raise CacheRejected("unreadable layer classes") from exc
    if not isinstance(classes, list) or len(classes) != layers:
        raise CacheRejected("layer count does not match the model")
    for name in classes:
        if name is not None and name not in CODECS:
            raise CacheRejected(f"unknown cache class {name!r}")
    return classes
