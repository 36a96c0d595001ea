"""Quantized KV caches that keep replies intact: the app's 8-bit and 4-bit.

mlx-lm's `QuantizedKVCache` quantizes every key and value with one bit width.
At 4 bits that makes small models loop: a few key channels carry large
outliers, and the first tokens (attention sinks) and the last few (what the
next word mostly depends on) lose the precision the model leans on most.
`MixedKVCache` stores the bulk of the context quantized, with

- separate bit widths for keys and values (keys are the sensitive half),
- 16-bit copies of the first `sink` and the last `window` tokens, written
  over their dequantized rows when attention reads the cache,
- optionally the keys rotated by a Walsh-Hadamard transform before
  quantizing, which spreads an outlier channel over the whole group.

Attention reads the cache back as one dequantized array per layer (a
temporary the size of one layer's keys and values), so it runs wherever
`mx.fast.scaled_dot_product_attention` does, the CUDA backend included, whose
`quantized_matmul` lacks the decode shapes mlx-lm's quantized attention needs.

A layer can also be a sliding window (`max_size`), the quantized counterpart
of mlx-lm's `RotatingKVCache`: old tokens are dropped from the front, keeping
the first `keep`. Tokens are always held in temporal order.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache, create_attention_mask

from app.engine.kvscheme import KVScheme, parse_format

_SIXTEEN = (mx.float16, mx.bfloat16)


def _sixteen(x: mx.array) -> mx.array:
    """Full-precision parts are kept in 16 bits: the model's own 16-bit type, or
    float16 where it computes in float32 (the CPU path)."""
    return x if x.dtype in _SIXTEEN else x.astype(mx.float16)


def _as(x: mx.array, dtype: mx.Dtype) -> mx.array:
    return x if x.dtype == dtype else x.astype(dtype)


class TokenStore:
    """One half (keys or values) of a layer's tokens along axis 2, float16 or
    quantized, in a buffer that grows in steps and can drop tokens from its front."""

    step = 256

    def __init__(self, bits: int | None, group_size: int, rotate: bool = False) -> None:
        self.bits, self.group_size, self.rotate = bits, group_size, rotate
        self.buffers: list[mx.array] = []
        self.lo = self.hi = 0

    def __len__(self) -> int:
        return self.hi - self.lo

    def encode(self, x: mx.array) -> list[mx.array]:
        if self.rotate:  # before the cast: float16 arithmetic is emulated on the CPU
            x = mx.hadamard_transform(x, scale=1 / math.sqrt(x.shape[-1]))
        x = _sixteen(x)
        if self.bits is None:
            return [x]
        return list(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def decode(self, parts: list[mx.array], dtype: mx.Dtype) -> mx.array:
        if self.bits is None:
            x = parts[0]
        else:
            weights, scales, biases = parts
            if dtype == mx.float32:
                # CPU float16 arithmetic is emulated: dequantizing with float16 scales
                # took 6x as long as with the (small) scales upcast first.
                scales, biases = scales.astype(dtype), biases.astype(dtype)
            x = mx.dequantize(weights, scales, biases, group_size=self.group_size, bits=self.bits)
        x = _as(x, dtype)
        if self.rotate:  # the normalized transform is its own inverse
            x = mx.hadamard_transform(x, scale=1 / math.sqrt(x.shape[-1]))
        return x

    def append(self, x: mx.array) -> None:
        self.append_encoded(self.encode(x))

    def append_encoded(self, parts: list[mx.array]) -> None:
        n = parts[0].shape[2]
        if not self.buffers or self.hi + n > self.buffers[0].shape[2]:
            self._regrow(n, parts)
        for buffer, part in zip(self.buffers, parts, strict=True):
            buffer[..., self.hi : self.hi + n, :] = part
        self.hi += n

    def _regrow(self, n: int, parts: list[mx.array]) -> None:
        """Move the live tokens to the front of a buffer with room for `n` more."""
        size = len(self)
        capacity = (size + n + self.step - 1) // self.step * self.step
        grown = []
        for i, part in enumerate(parts):
            shape = (*part.shape[:2], capacity, part.shape[3])
            fresh = mx.zeros(shape, part.dtype)
            if size:
                fresh[..., :size, :] = self.buffers[i][..., self.lo : self.hi, :]
            grown.append(fresh)
        self.buffers, self.lo, self.hi = grown, 0, size

    def encoded(self, start: int = 0, end: int | None = None) -> list[mx.array]:
        end = len(self) if end is None else end
        return [b[..., self.lo + start : self.lo + end, :] for b in self.buffers]

    def read(self, dtype: mx.Dtype, start: int = 0, end: int | None = None) -> mx.array:
        return self.decode(self.encoded(start, end), dtype)

    def drop(self, n: int, after: int = 0) -> None:
        """Drop `n` tokens, keeping the first `after` (a sliding window's kept tokens)."""
        n = min(n, len(self) - after)
        if n <= 0:
            return
        if after:  # rare (mlx-lm's `keep`): move the kept tokens up by a copy
            for buffer in self.buffers:
                buffer[..., self.lo + n : self.lo + n + after, :] = mx.array(
                    buffer[..., self.lo : self.lo + after, :]
                )
        self.lo += n

    def trim(self, n: int) -> None:
        self.hi -= min(n, len(self))

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    @property
    def dtype(self) -> mx.Dtype:
        """The 16-bit type it dequantizes from (its scales' type when quantized)."""
        return self.buffers[0 if self.bits is None else 1].dtype


class MixedKVCache:
    """A layer's KV cache stored per `KVScheme`, a drop-in for mlx-lm's KVCache and
    RotatingKVCache (`max_size`). Every token is held quantized (the bulk); float16
    copies of the first `sink` and the last `window` tokens are written over their
    rows when attention reads the cache, so the copies cost a few tokens of memory
    and no concatenation."""

    def __init__(self, scheme: KVScheme, max_size: int | None = None, keep: int = 0) -> None:
        self._setup(scheme, max_size, keep)

    def _setup(self, scheme: KVScheme, max_size: int | None, keep: int) -> None:
        self.scheme = scheme
        self.max_size, self.keep = max_size, keep
        # A sliding window keeps its own first `keep` tokens, no others, as sinks.
        self.sink_size = scheme.sink if max_size is None else keep
        self.offset = 0
        self.bulk = [
            TokenStore(scheme.key_bits, scheme.group_size, scheme.rotate_keys),
            TokenStore(scheme.value_bits, scheme.group_size),
        ]
        self.sink: list[mx.array | None] = [None, None]
        self.recent: list[mx.array | None] = [None, None]

    # -- the interface mlx-lm's models call ------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.max_size is not None:
            excess = self.stored() - (self.max_size - 1)
            for store in self.bulk:
                store.drop(excess, after=self.sink_size)
        self.extend(keys, values)
        self.offset += keys.shape[2]
        return self._fetch(0, keys.dtype), self._fetch(1, values.dtype)

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        if self.max_size is None:
            return create_attention_mask(N, self.offset, return_array, window_size)
        window_size = window_size or self.max_size
        offset = min(self.max_size - 1, self.offset)  # stored tokens before these N
        if N == 1 and window_size >= self.max_size:
            return None
        if N > 1 and offset + N <= window_size and not return_array:
            return "causal"
        return create_causal_mask(N, offset, window_size=window_size)

    def size(self) -> int:
        return self.stored()

    def empty(self) -> bool:
        return self.offset == 0

    def is_trimmable(self) -> bool:
        return self.max_size is None or self.offset < self.max_size

    def trim(self, n: int) -> int:
        n = min(n, self.stored())
        left = self.stored() - n
        for part in (0, 1):
            self.bulk[part].trim(n)
            recent, sink = self.recent[part], self.sink[part]
            if recent is not None:
                kept = recent.shape[2] - n
                self.recent[part] = recent[..., :kept, :] if kept > 0 else None
            if sink is not None and sink.shape[2] > left:
                self.sink[part] = sink[..., :left, :] if left else None
        self.offset -= n
        return n

    def set_window(self, window: int) -> None:
        """Keep the last `window` tokens in float16 from now on (a restored cache
        comes back without its window)."""
        self.scheme = replace(self.scheme, window=window)

    @property
    def nbytes(self) -> int:
        total = sum(store.nbytes for store in self.bulk)
        return total + sum(a.nbytes for a in (*self.sink, *self.recent) if a is not None)

    @property
    def state(self) -> tuple:
        """Everything held, exactly: (bulk keys, bulk values, sink k, sink v,
        recent k, recent v, offset, format, window, max_size, keep)."""
        bulk = [tuple(s.encoded()) if s.buffers else None for s in self.bulk]
        return (
            *bulk,
            *self.sink,
            *self.recent,
            self.offset,
            self.scheme.format,
            self.scheme.window,
            self.max_size,
            self.keep,
        )

    @state.setter
    def state(self, state: tuple) -> None:
        bulk_k, bulk_v, sink_k, sink_v, recent_k, recent_v, offset, fmt, window, max_size, keep = (
            state
        )
        self._setup(replace(parse_format(fmt), window=int(window)), max_size, int(keep))
        for part, bulk in enumerate((bulk_k, bulk_v)):
            if bulk is not None:
                self.bulk[part].append_encoded(list(bulk) if isinstance(bulk, tuple) else [bulk])
        self.sink, self.recent = [sink_k, sink_v], [recent_k, recent_v]
        self.offset = int(offset)
        copies = [a.shape[2] for a in (sink_k, sink_v, recent_k, recent_v) if a is not None]
        if (
            len(self.bulk[0]) != len(self.bulk[1])
            or self.stored() > self.offset
            or any(n > self.stored() for n in copies)
        ):
            raise ValueError("inconsistent token counts")

    # -- storage -----------------------------------------------------------------

    def stored(self) -> int:
        return len(self.bulk[0])

    def extend(self, keys: mx.array, values: mx.array) -> None:
        """Store tokens (without counting them in `offset`)."""
        for part, x in enumerate((keys, values)):
            self.bulk[part].append(x)
            sink = self.sink[part]
            have = sink.shape[2] if sink is not None else 0
            if have < self.sink_size:  # only while the first tokens arrive
                first = _sixteen(x[..., : self.sink_size - have, :])
                self.sink[part] = first if sink is None else mx.concatenate([sink, first], axis=2)
            window = min(self.scheme.window, len(self.bulk[part]))  # a sliding one may be smaller
            if window:
                tail = _sixteen(x[..., -window:, :])
                recent = self.recent[part]
                if recent is not None and tail.shape[2] < window:
                    older = recent[..., -(window - tail.shape[2]) :, :]
                    tail = mx.concatenate([older, tail], axis=2)
                self.recent[part] = tail

    def _fetch(self, part: int, dtype: mx.Dtype) -> mx.array:
        x = self.bulk[part].read(dtype)
        n = x.shape[2]
        recent, sink = self.recent[part], self.sink[part]
        if recent is not None:
            r = min(recent.shape[2], n)
            x[..., n - r :, :] = _as(recent[..., recent.shape[2] - r :, :], dtype)
        if sink is not None:
            x[..., : sink.shape[2], :] = _as(sink, dtype)
        return x

    def dequantized(self) -> tuple[mx.array, mx.array]:
        """(keys, values) as attention reads them, in their 16-bit type."""
        return tuple(self._fetch(part, self.bulk[part].dtype) for part in (0, 1))

    def quantized_tokens(self, start: int, end: int) -> dict[str, mx.array]:
        """Tokens [start, end) of what is stored, as cache files hold them: every one
        quantized, plus the float16 sink in the first chunk. A token is quantized once,
        on arrival, so a saved chunk is the same whenever it is written."""
        named = {}
        for part, prefix in enumerate("kv"):
            for n, array in enumerate(self.bulk[part].encoded(start, end)):
                named[f"{prefix}.{n}"] = array
            if start == 0 and self.sink[part] is not None:
                named[f"s{prefix}"] = self.sink[part]
        return named

    @classmethod
    def from_quantized(cls, scheme: KVScheme, named: dict[str, mx.array]) -> MixedKVCache:
        """Rebuild from `quantized_tokens` of a whole cache."""
        layer = cls(replace(scheme, window=0))
        for part, prefix in enumerate("kv"):
            count = 1 if layer.bulk[part].bits is None else 3
            layer.bulk[part].append_encoded([named[f"{prefix}.{n}"] for n in range(count)])
            layer.sink[part] = named.get(f"s{prefix}")
        layer.offset = layer.stored()
        return layer


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

    def quantize(cache: list) -> None:
        for i, layer in enumerate(cache):
            if type(layer) in (KVCache, RotatingKVCache) and layer.offset >= start:
                cache[i] = to_mixed(layer, scheme)

    return quantize
