"""Converting mlx-lm's full-precision cache layers to the app's quantized ones.

A conversion is lossless up to the scheme: the layer's tokens are re-stored as if
they had arrived in a `MixedKVCache` (a `ChunkedMixedKVCache` for a chunked layer).
Recurrent and convolution states stay exact.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.models.cache import CacheList, ChunkedKVCache, KVCache, RotatingKVCache

from app.engine.kvchunked import ChunkedMixedKVCache
from app.engine.kvquant import MixedKVCache
from app.engine.kvscheme import SIXTEEN_BIT, KVScheme

# The full-precision attention layers the KV preference quantizes.
QUANTIZABLE = (KVCache, RotatingKVCache, ChunkedKVCache)


def _empty_counterpart(layer, scheme: KVScheme) -> MixedKVCache:
    """A quantized layer of `layer`'s kind (its window or chunk), holding nothing yet."""
    if isinstance(layer, RotatingKVCache | MixedKVCache) and layer.max_size is not None:
        return MixedKVCache(scheme, layer.max_size, layer.keep)
    if isinstance(layer, ChunkedKVCache | ChunkedMixedKVCache):
        chunked = ChunkedMixedKVCache(scheme, layer.chunk_size)
        chunked.start_position = layer.start_position
        return chunked
    return MixedKVCache(scheme)


def _held_in_order(layer) -> tuple[mx.array, mx.array] | None:
    """The keys and values `layer` holds, oldest first; None before its first token."""
    if isinstance(layer, MixedKVCache):  # the CPU path's float16 (`SIXTEEN_BIT`)
        return layer.dequantized() if layer.count else None
    if layer.keys is None:
        return None
    if isinstance(layer, ChunkedKVCache):  # from its start position to its offset
        return layer.keys_and_values()
    if isinstance(layer, RotatingKVCache) and layer.offset > layer.keys.shape[2]:
        # a full ring: put its tokens back in temporal order
        return layer._temporal_order(layer.keys), layer._temporal_order(layer.values)
    return layer.keys[..., : layer.offset, :], layer.values[..., : layer.offset, :]


def to_mixed(layer, scheme: KVScheme) -> MixedKVCache:
    """A full-precision layer's tokens (mlx-lm's, or float16 ones) re-stored per `scheme`
    (lossless up to the scheme)."""
    mixed = _empty_counterpart(layer, scheme)
    held = _held_in_order(layer)
    if held is not None and held[0].shape[2]:
        mixed.extend(*held)
    mixed.offset = layer.offset
    return mixed


def _full_precision(layer, scheme: KVScheme) -> bool:
    """Whether `layer` holds its tokens in full precision for `scheme`: mlx-lm's
    layers, and float16 ones (`SIXTEEN_BIT`) where a quantized scheme is wanted."""
    if type(layer) in QUANTIZABLE:
        return True
    mixed = type(layer) in (MixedKVCache, ChunkedMixedKVCache)
    held = mixed and layer.scheme.format == SIXTEEN_BIT.format
    return held and scheme != SIXTEEN_BIT


def quantizer(scheme: KVScheme | None, start: int = 0) -> Callable[[list], None]:
    """Converts a cache's full-precision layers in place once `start` tokens are in it."""
    if scheme is None:
        return lambda cache: None

    def converted(layer):
        if type(layer) is CacheList:  # its attention part; the recurrent state stays exact
            layer.caches = tuple(converted(part) for part in layer.caches)
        elif _full_precision(layer, scheme) and layer.offset >= start:
            return to_mixed(layer, scheme)
        return layer

    def quantize(cache: list) -> None:
        for i, layer in enumerate(cache):
            cache[i] = converted(layer)

    return quantize
