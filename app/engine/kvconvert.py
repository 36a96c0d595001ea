"""Converting mlx-lm's full-precision cache layers to the app's quantized ones.

A conversion is lossless up to the scheme: the layer's tokens are re-stored as if
they had arrived in a `MixedKVCache`. Recurrent and convolution states stay exact.
"""

from __future__ import annotations

from collections.abc import Callable

from mlx_lm.models.cache import CacheList, KVCache, RotatingKVCache

from app.engine.kvquant import MixedKVCache
from app.engine.kvscheme import KVScheme


def to_mixed(layer: KVCache | RotatingKVCache, scheme: KVScheme) -> MixedKVCache:
    """A full-precision layer's tokens re-stored per `scheme` (lossless up to the scheme)."""
    if isinstance(layer, RotatingKVCache):
        mixed = MixedKVCache(scheme, layer.max_size, layer.keep)
        in_order = layer.keys is not None and layer.offset > layer.keys.shape[2]
    else:
        mixed, in_order = MixedKVCache(scheme), False
    if layer.keys is not None:
        if in_order:  # a full ring: put its tokens back in temporal order
            keys, values = layer._temporal_order(layer.keys), layer._temporal_order(layer.values)
        else:
            keys, values = layer.keys[..., : layer.offset, :], layer.values[..., : layer.offset, :]
        if keys.shape[2]:
            mixed.extend(keys, values)
    mixed.offset = layer.offset
    return mixed


def quantizer(scheme: KVScheme | None, start: int = 0) -> Callable[[list], None]:
    """Converts a cache's full-precision layers in place once `start` tokens are in it."""
    if scheme is None:
        return lambda cache: None

    def converted(layer):
        if type(layer) is CacheList:  # its attention part; the recurrent state stays exact
            layer.caches = tuple(converted(part) for part in layer.caches)
        elif type(layer) in (KVCache, RotatingKVCache) and layer.offset >= start:
            return to_mixed(layer, scheme)
        return layer

    def quantize(cache: list) -> None:
        for i, layer in enumerate(cache):
            cache[i] = converted(layer)

    return quantize
