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
from app.engine.kvscheme import KVScheme, parse_format
from app.engine.kvwindow import (
    FLUSH,
    app_window,
    copy_name,
    copy_span,
    covering_copies,
    flush_block,
    quantized_at,
    tail_rows_at,
    tail_start_at,
)
from app.engine.tokenstore import TokenStore, as_dtype, joined, layer_rows, sixteen_bit


class MixedKVCache:
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

    @property
    def state(self) -> tuple:
        """Everything held, exactly: (bulk keys, bulk values [every token quantized],
        sink k, sink v, recent k, recent v [the 16-bit tail], offset, format, window,
        max_size, keep)."""
        bulk = [tuple(self._all_quantized(p)) if self.count else None for p in (0, 1)]
        return (
            *bulk,
            *(self._sink(p) for p in (0, 1)),
            *(self._tail(p) for p in (0, 1)),
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
                parts = list(bulk) if isinstance(bulk, tuple) else [bulk]
                if len(parts) != (1 if self.bulk[part].bits is None else 3):
                    raise ValueError("the stored tokens do not match the format")  # a file's
                self.bulk[part].append_encoded(parts)
        self.offset, self.count = int(offset), len(self.bulk[0])
        pairs = ((sink_k, sink_v), (recent_k, recent_v))
        copies = [a.shape[2] for pair in pairs for a in pair if a is not None]
        if (
            len(self.bulk[0]) != len(self.bulk[1])
            or self.count > self.offset
            or any(n > self.count for n in copies)
            or any((a is None) != (b is None) for a, b in pairs)
        ):
            raise ValueError("inconsistent token counts")
        recent = recent_k.shape[2] if recent_k is not None else 0
        for part in (0, 1):  # the recent tokens are held in 16 bits, not quantized
            self.bulk[part].trim(recent)
        self._take_saved_codes()
        start = self._tail_start()  # recent rows may overlap the sink
        for part, (sink, tail) in enumerate(((sink_k, recent_k), (sink_v, recent_v))):
            if sink is not None and self.sink_size:
                self.exact[part].append_encoded([sink[..., : self._sink_rows(), :]])
            if tail is not None and start < self.count:
                self.exact[part].append_encoded([tail[..., start - self.count :, :]])
        if len(self.exact[0]) != self._sink_rows() + self._tail_rows():
            raise ValueError("the sink does not match the scheme")

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

    def quantized_tokens(
        self, start: int, end: int, whole_tail: bool = False
    ) -> dict[str, mx.array]:
        """Tokens [start, end) of what is stored, as cache files hold them: every one
        quantized, plus the 16-bit sink in the first chunk and a 16-bit copy of the
        chunk's positions in the tail ("r<first>-<end>k", `_copied_from`), so that the
        layer restored from its chunks is this one."""
        named = {}
        first = self._copied_from(start, end, whole_tail)
        for part, prefix in enumerate("kv"):
            for n, array in enumerate(self._all_quantized(part, start, end)):
                named[f"{prefix}.{n}"] = array
            sink = self._sink(part)
            if start == 0 and sink is not None:
                named[f"s{prefix}"] = sink
            if first is not None:
                row = self._exact_row(first)
                copy = self.exact[part].encoded(row, row + end - first)[0]
                named[copy_name(first, end, prefix)] = copy
        return named

    def tail_is_dequantized(self) -> bool:
        """Whether some of the 16-bit tail holds dequantized values (a cut moved rows back
        from the bulk, `_unflush`), where the chunks' copies hold them as computed."""
        return self._dequantized_end > self._tail_start()

    def _copied_from(self, start: int, end: int, whole_tail: bool) -> int | None:
        """Where the 16-bit copy of a chunk of positions [start, end) begins: at its first
        position in the tail, each chunk its own, so that a turn writes its new rows
        once; for the last chunk (`end` is the whole cache), at the tail's start when
        asked (`whole_tail`: the chunks before lack theirs) or when the tail holds
        dequantized rows (after a cut, where the chunks before hold them as computed).
        None for no copy: none of its positions is in the tail, or the tail is not the
        one a reader expects (`tail_rows_at` of the saved format)."""
        saved_as = parse_format(self.scheme.format)  # what a reader knows of the scheme
        if self.front_moves() or self._tail_rows() != tail_rows_at(self.count, saved_as):
            return None
        tail = self._tail_start()
        whole = whole_tail or self.tail_is_dequantized()
        if whole and end < self.count:
            return None  # the last chunk's copy holds this one's rows
        first = tail if whole else max(start, tail)
        return first if first < end else None

    @classmethod
    def from_quantized(
        cls, scheme: KVScheme, named: dict[str, list | mx.array], count: int
    ) -> list[MixedKVCache]:
        """Layers rebuilt from `quantized_tokens` of a whole cache of `count` tokens, for
        a run of layers: the bulk's tensors ("k.0", "v.2") as an array per layer, which
        become the layers' buffers as they are (so they may hold room past `count`); the
        16-bit sink and the chunks' copies of recent rows stacked along a first axis, a
        row per layer (as a chunk file holds them). Without 16-bit copies of the whole
        tail (a restore that ends at a checkpoint before the conversation does; a file
        written before they were saved) the recent rows come back dequantized, as after
        a `trim`: the layer is what `quantized_at` says, and its next save writes the
        whole tail's copy."""
        scheme = replace(scheme, window=app_window(scheme))
        layers = [cls(scheme) for _ in range(len(named["k.0"]))]
        tails = [_tail_from_copies(named, prefix, count, scheme) for prefix in "kv"]
        if any(t is None for t in tails):
            tails = [None, None]
        quantized = count if tails[0] is None else quantized_at(count, scheme.window, scheme)
        sink_rows = min(layers[0].sink_size, count)
        for part, prefix in enumerate("kv"):
            parts = 1 if layers[0].bulk[part].bits is None else 3
            bulk = [named[f"{prefix}.{n}"] for n in range(parts)]
            sink = named.get(f"s{prefix}")
            rows = [sink[..., :sink_rows, :]] if sink is not None and sink_rows else []
            rows += tails[part] or []  # joined once with the sink, below
            held, step = sum(r.shape[3] for r in rows), layers[0].exact[part].step
            exact = layer_rows(joined(rows, (held // step + 1) * step)) if rows else None
            for i, layer in enumerate(layers):
                layer.bulk[part].hold([b[i] for b in bulk], quantized)
                if exact is not None:
                    layer.exact[part].hold([exact[i]], held)
        for layer in layers:
            layer.count = layer.offset = count
            layer._take_saved_codes()
            if tails[0] is None:
                layer._unflush(quantized_at(count, scheme.window, scheme))
        return layers

    def _take_saved_codes(self) -> None:
        """A layer rebuilt from its saved codes keeps those of its 16-bit rows too,
        past the bulk's end: they are the live layer's (its tail may hold rows a trim
        dequantized, which quantized again would not always give the same codes)."""
        if not self.front_moves():
            self._coded = self.count


def _tail_from_copies(
    named: dict, part: str, count: int, scheme: KVScheme
) -> list[mx.array] | None:
    """The 16-bit rows of positions [tail_start_at(count), count) of `part` ("k", "v"),
    layers first, in pieces of the chunks' copies (`covering_copies`); None when they
    do not hold every one (or there are none to hold)."""
    start = tail_start_at(count, scheme)
    copies = [
        (span, array)
        for name, array in named.items()
        if (span := copy_span(name, scheme)) and span[2] == part
    ]
    copies.sort(key=lambda copy: copy[0][1])  # in their chunks' order: by their ends
    picks = covering_copies([span[:2] for span, _ in copies], start, count)
    if not picks:
        return None
    return [copies[i][1][..., a - copies[i][0][0] : b - copies[i][0][0], :] for i, a, b in picks]
