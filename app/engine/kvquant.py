"""Quantized KV caches that keep replies intact: the app's 8-bit and 4-bit.

mlx-lm's `QuantizedKVCache` quantizes every key and value with one bit width.
At 4 bits that makes small models loop: a few key channels carry large
outliers, and the first tokens (attention sinks) and the last few (what the
next word mostly depends on) lose the precision the model leans on most.
`MixedKVCache` stores the bulk of the context quantized, with

- separate bit widths for keys and values (keys are the sensitive half),
- the first `sink` and the last `window` tokens (up to `FLUSH` more) in 16
  bits, attended to at that precision,
- optionally the keys rotated by a Walsh-Hadamard transform before
  quantizing, which spreads an outlier channel over the whole group.

A token arrives in the layer's 16-bit store and is quantized once it is
`window` tokens old, `FLUSH` tokens at a time: a decode step then writes one
16-bit row per half, as mlx-lm's own cache does, instead of quantizing it and
writing six arrays. A token is quantized from its 16-bit copy, the same bits
whenever that happens, so a saved chunk is the same whenever it is written.

Attention reads the packed cache directly (app/engine/kvattention.py): the
layer hands mlx-lm's model code a `PackedRead` instead of dequantized arrays
once the patched attention has shown it routes this layer's calls.
`reference_read` is what attention read before that (every token
dequantized, the 16-bit rows written over theirs): the test oracle, and the
fallback for model code that does not call mlx-lm's attention function.

How a layer is saved (a snapshot's state, a chunk file's tensors) and built back
from its files is in app/engine/kvquant_saved.py, its base class.

A layer can also be a sliding window (`max_size`), the quantized counterpart
of mlx-lm's `RotatingKVCache`: old tokens are dropped from the front, keeping
the first `keep`. Tokens are always held in temporal order.
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import create_attention_mask

from app.engine import kvattention
from app.engine.kvattention import PackedLayout, PackedRead
from app.engine.kvquant_saved import SavedLayer
from app.engine.kvscheme import KVScheme
from app.engine.kvwindow import FLUSH, flush_block, quantized_at
from app.engine.tokenstore import TokenStore, as_dtype, sixteen_bit


class MixedKVCache(SavedLayer):
    """A layer's KV cache stored per `KVScheme`, a drop-in for mlx-lm's KVCache and
    RotatingKVCache (`max_size`).

    Positions [0, q) are held quantized in `bulk` (q = len(bulk)), the sink ones
    included, so that every token can be saved quantized. `exact` holds, in 16
    bits and in order, the first `sink_size` positions and the tail [max(q, S), n):
    the tokens not yet quantized, at least `window` of them."""

    def __init__(self, scheme: KVScheme, max_size: int | None = None, keep: int = 0) -> None:
        self._setup(scheme, max_size, keep)
        kvattention.install()

    def _setup(self, scheme: KVScheme, max_size: int | None, keep: int) -> None:
        self.scheme = scheme
        self.max_size, self.keep = max_size, keep
        # A sliding window keeps its own first `keep` tokens, no others, as sinks.
        self.sink_size = scheme.sink if max_size is None else keep
        self.offset = self.count = 0
        self.bulk = [
            TokenStore(scheme.key_bits, scheme.group_size, scheme.rotate_keys),
            TokenStore(scheme.value_bits, scheme.group_size),
        ]
        self.exact = [TokenStore(None, scheme.group_size, step=64) for _ in range(2)]
        # Positions before this have their codes in the bulk's buffers, also those a
        # trim moved back to 16 bits (`_unflush`): flushed again, or saved, they keep
        # the codes they were first given, as the saved chunks hold them.
        self._coded = 0
        # Tail positions before this hold dequantized values (`_unflush`), not the ones
        # computed: a save then writes the whole tail's 16-bit rows again.
        self._dequantized_end = 0
        self.packed_reads = False  # set by the patched attention (kvattention)
        self.handshake: tuple | None = None

    # -- the interface mlx-lm's models call ------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple:
        if self.max_size is not None:
            self._drop_front(self.count - (self.max_size - 1))
        self.extend(keys, values)
        self.offset += keys.shape[2]
        if self.packed_reads:
            return PackedRead(self, 0, keys.dtype), PackedRead(self, 1, values.dtype)
        self.handshake = (self.reference_read(0, keys.dtype), self.reference_read(1, values.dtype))
        return self.handshake

    def attend(self, queries: mx.array, scale: float, mask, sinks=None) -> mx.array:
        """Attention of `queries` over this layer's tokens, from the packed cache."""
        self.handshake = None
        return kvattention.attend(self.layout(), queries, scale, mask, sinks)

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
        return self.count

    def empty(self) -> bool:
        return self.offset == 0

    def is_trimmable(self) -> bool:
        return self.max_size is None or self.offset < self.max_size

    def trim(self, n: int) -> int:
        n = min(n, self.count)
        left = self.count - n
        q, tail_rows, sink_rows = self.quantized(), self._tail_rows(), self._sink_rows()
        coded = max(self._coded, q)
        tail_keep = max(0, left - self._tail_start())
        sink_keep = min(self.sink_size, left) if tail_keep == 0 else sink_rows
        for part in (0, 1):
            self.exact[part].trim(tail_rows - tail_keep + sink_rows - sink_keep)
            self.bulk[part].trim(q - min(q, left))
        self.count = left
        self.offset -= n
        self._dequantized_end = min(self._dequantized_end, left)
        if not self.front_moves():
            self._unflush(quantized_at(left, self.scheme.window, self.scheme))
        self._coded = 0 if self.front_moves() else min(coded, left)
        return n

    def _unflush(self, until: int) -> None:
        """After a trim into the quantized rows: hold positions [until, q) in 16 bits
        again (their dequantized values), so that the layer is what `quantized_at`
        says, as a cache restored from its files will be."""
        q, start = self.quantized(), max(until, self.sink_size)
        if start >= q:
            return
        self._dequantized_end = max(self._dequantized_end, q)
        for part in (0, 1):
            exact, sink_rows = self.exact[part], self._sink_rows()
            dtype = exact.dtype if exact.buffers else self.bulk[part].dtype
            rows = [self.bulk[part].read(dtype, start, q)]
            if exact.buffers:
                rows = [exact.encoded(0, sink_rows)[0], *rows, exact.encoded(sink_rows)[0]]
            exact.buffers, exact.lo, exact.hi = [], 0, 0
            exact.append_encoded([mx.concatenate(rows, axis=2)])
            self.bulk[part].trim(q - until)

    def set_window(self, window: int) -> None:
        """Keep the last `window` tokens in 16 bits from now on (a restored cache
        comes back without its window)."""
        self.scheme = replace(self.scheme, window=window)

    def describe(self) -> str:
        """The layer's format in words, with the sink it really keeps (a sliding
        window keeps only its own `keep` tokens)."""
        return replace(self.scheme, sink=self.sink_size).describe()

    @property
    def nbytes(self) -> int:
        return sum(store.nbytes for store in (*self.bulk, *self.exact))

    # -- storage -----------------------------------------------------------------

    def front_moves(self) -> bool:
        """Whether old tokens leave the front (a sliding window), so that a stored
        token's position changes: what is quantized then follows the window, not
        `quantized_at` of the position."""
        return self.max_size is not None

    def stored(self) -> int:
        return self.count

    def quantized(self) -> int:
        return len(self.bulk[0])

    def _tail_start(self) -> int:
        return max(self.quantized(), self.sink_size)

    def _sink_rows(self) -> int:
        return min(self.sink_size, self.count)

    def _tail_rows(self) -> int:
        return max(0, self.count - self._tail_start())

    def _exact_row(self, position: int) -> int:
        """Where a 16-bit position lives in `exact` (positions [q, n) are contiguous)."""
        if position < self.sink_size:
            return position
        return self._sink_rows() + position - self._tail_start()

    def _sink(self, part: int) -> mx.array | None:
        rows = self._sink_rows()
        return self.exact[part].encoded(0, rows)[0] if rows else None

    def _tail(self, part: int) -> mx.array | None:
        rows = self._tail_rows()
        return self.exact[part].encoded(self._sink_rows())[0] if rows else None

    def extend(self, keys: mx.array, values: mx.array) -> None:
        """Store tokens (without counting them in `offset`)."""
        block = flush_block(self.scheme)
        if block == 1 and not self.sink_size and not self.scheme.window:
            # Nothing is held apart in 16 bits: the tokens go to the bulk as they come,
            # and the 16-bit stores hold an empty buffer (what attention reads of them).
            for part, x in enumerate((keys, values)):
                self.bulk[part].append_encoded(self.bulk[part].encode(x))
                if not self.exact[part].buffers:
                    self.exact[part].append_encoded([sixteen_bit(x[..., :0, :])])
            self.count += keys.shape[2]
            return
        for part, x in enumerate((keys, values)):
            self.exact[part].append_encoded([sixteen_bit(x)])
        self.count += keys.shape[2]
        if self.front_moves():  # the tail may run FLUSH past the window, a 16-bit one not
            if self._tail_rows() > self.scheme.window + (0 if block == 1 else FLUSH):
                self._flush(self.count - self.scheme.window)
        else:
            until = quantized_at(self.count, self.scheme.window, self.scheme)
            if until > self.quantized():
                self._flush(until)

    def _flush(self, until: int) -> None:
        """Quantize positions [q, until) and drop their 16-bit tail rows. Positions whose
        codes the bulk still holds (`_coded`) take those back: their 16-bit rows are
        dequantized ones, which quantized again would not always give the same codes."""
        q, start, sink_rows = self.quantized(), self._tail_start(), self._sink_rows()
        kept = max(0, min(until, self._coded) - q)
        row = self._exact_row(q + kept)
        for part in (0, 1):
            self.bulk[part].untrim(kept)
            if until > q + kept:
                rows = self.exact[part].encoded(row, row + until - q - kept)[0]
                self.bulk[part].append_encoded(self.bulk[part].encode(rows))
            self.exact[part].drop(max(0, until - start), after=sink_rows)
            self.exact[part].compact()
        if not self.front_moves():  # a sliding window's positions move: it keeps none
            self._coded = max(self._coded, until)

    def _drop_front(self, n: int) -> None:
        """A sliding window: drop the `n` oldest tokens after the first `keep`."""
        if n <= 0:
            return
        from_bulk = min(n, max(0, self.quantized() - self.keep))
        sink_rows = self._sink_rows()
        for part in (0, 1):
            self.bulk[part].drop(from_bulk, after=self.keep)
            self.exact[part].drop(n - from_bulk, after=sink_rows)
        self.count -= n

    def _all_quantized(self, part: int, start: int = 0, end: int | None = None) -> list:
        """Positions [start, end) quantized: the bulk's, then the 16-bit ones encoded."""
        end = self.count if end is None else end
        q = max(self.quantized(), min(self._coded, end))  # the bulk's codes, kept ones too
        parts = self.bulk[part].encoded(start, min(end, q)) if start < q else None
        if end > max(start, q):
            row = self._exact_row(max(start, q))
            rows = self.exact[part].encoded(row, row + end - max(start, q))[0]
            fresh = self.bulk[part].encode(rows)
            parts = (
                fresh
                if parts is None
                else [mx.concatenate(pair, axis=2) for pair in zip(parts, fresh, strict=True)]
            )
        return parts

    def reference_read(self, part: int, dtype: mx.Dtype) -> mx.array:
        """Every token dequantized, the 16-bit rows written over theirs."""
        q, sink = self.quantized(), self._sink_rows()
        pieces = [self.bulk[part].read(dtype)] if q else []
        if self.count > q:
            row = self._exact_row(q)
            pieces.append(as_dtype(self.exact[part].encoded(row)[0], dtype))
        x = mx.concatenate(pieces, axis=2) if len(pieces) > 1 else pieces[0]
        if sink and q:
            x[..., :sink, :] = as_dtype(self.exact[part].encoded(0, sink)[0], dtype)
        return x

    def dequantized(self) -> tuple[mx.array, mx.array]:
        """(keys, values) as attention reads them, in their 16-bit type."""
        return tuple(self.reference_read(part, self._dtype(part)) for part in (0, 1))

    def _dtype(self, part: int) -> mx.Dtype:
        store = self.bulk[part] if self.bulk[part].buffers else self.exact[part]
        return store.dtype

    def layout(self) -> PackedLayout:
        sink = self._sink_rows()
        lo = sink if self.quantized() > sink else self.quantized()
        return PackedLayout(
            bulk=self.bulk,
            bulk_start=lo,
            bulk_end=self.quantized(),
            exact=self.exact,
            sink_rows=sink,
            count=self.count,
        )
