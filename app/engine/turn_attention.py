"""A short turn's attention over the CPU path's cache, float16 rows or a bulk packed
4 or 8 bits, by compiled products (short_turn.c through kvnative).

A follow-up message of a few tokens at a long history is, per layer and KV head,
a few dozen query rows (the turn's rows times the query heads sharing the KV head)
against every cached token: scores, softmax, values. mlx's route widened every
row to float32 (`kvcpu.widened`) and ran OpenBLAS on it; at 4k tokens that was
most of a 17-token turn's time. Here the compiled code reads the float16 rows
where they are, widening a few at a time into the CPU's L1 cache, and numpy does
the causal mask and the softmax in between.

The scores come token-major (a row per cached token, the queries along it), the
layout both products want; a KV head's queries are ordered as its query heads
then the turn's rows (j = head * rows + row), padded with zero queries to the
products' tile.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np

from app.engine import cpu_attention, cpu_blas, kvcpu, kvnative, packed_rows

MAX_ROWS = 64  # a turn's rows this takes; a longer prompt is a prefill step's work


def applies(layout, queries: mx.array, mask, sinks) -> bool:
    """A float32 turn of 2..MAX_ROWS rows, no mask but the causal one, over float16
    rows (the CPU path's 16 bits) or a bulk packed 4 or 8 bits with float16 scales
    (the app's 8-bit and 4-bit), in a width the products take, where their AVX-512
    build runs."""
    heads, rows, dim = queries.shape[1:]
    stores = [s for s in (*layout.exact, *layout.bulk) if s.buffers]
    kv_heads = stores[0].buffers[0].shape[1] if stores else heads
    return (
        cpu_attention.enabled
        and kvnative.turn_faster_here()
        and kvnative.turn_fits(dim)
        and heads // kv_heads * rows <= kvnative.turn_max_queries()
        and mx.default_device() == mx.cpu
        and 1 < rows <= MAX_ROWS
        and sinks is None
        and (mask is None or mask == "causal")
        and queries.dtype == mx.float32
        and all(s.bits in (None, 4, 8) and s.dtype == mx.float16 for s in stores)
        and all(_width(s) == dim for s in stores)
        and all(_packed_rows_fit(s) for s in stores if s.bits is not None)
    )


def _packed_rows_fit(store) -> bool:
    """Whether a packed store's buffers are laid out as the compiled products read
    them (`kvnative.PackedTurnRows.takes`); elsewhere the dense path attends."""
    mx.eval(store.buffers)
    codes, scales, biases = (np.asarray(buffer)[0, 0] for buffer in store.buffers)
    return kvnative.PackedTurnRows.takes(store.bits, codes, scales, biases)


def _width(store) -> int:
    """A store's row width in values (its codes' words hold 32 / bits each)."""
    width = store.buffers[0].shape[3]
    return width if store.bits is None else width * 32 // store.bits


def attention(layout, queries: mx.array, scale: float, mask) -> mx.array:
    """What the dense path gives for `queries` over `layout` (kvattention.PackedLayout):
    rows that see every cached token but the turn's later ones (mask "causal"), or all.
    The KV heads are shared with a helper thread where the turn has two (`cpu_blas`)."""
    batch, heads, rows, dim = queries.shape
    mx.eval(queries, [store.buffers for store in (*layout.exact, *layout.bulk)])
    spans = _spans(layout)
    keys = [_Span(layout.exact[0] if exact else layout.bulk[0], a, b) for exact, a, b in spans]
    values = [_Span(layout.exact[1] if exact else layout.bulk[1], a, b) for exact, a, b in spans]
    kv_heads = keys[0].heads // batch
    used = heads // kv_heads * rows
    q = np.asarray(queries).reshape(batch * kv_heads, used, dim)
    qt = _transposed(q, scale)
    # Rotated keys (the app's 4-bit): the bulk's scores from the queries rotated alike.
    rotated = layout.rotated and layout.bulk_end > layout.bulk_start
    bulk_qt = _transposed(cpu_blas.stacked_matmul(q, kvcpu.hadamard(dim)), scale) if rotated else qt
    tile = kvnative.TURN_VALUE_QUERIES
    out = np.zeros((batch * kv_heads, -(-used // tile) * tile, dim), np.float32)

    def attend(first: int, last: int) -> None:
        """KV heads [first, last), one's scores at a time: 2 MB at 4k tokens, 17 MB for
        128 queries at 32k."""
        st = np.empty((sum(part.tokens for part in keys), qt.shape[2]), np.float32)
        for head in range(first, last):
            for part, into in zip(keys, _split(st, keys), strict=True):
                part.scores(head, (bulk_qt if part.store.rotate else qt)[head], into)
            if mask == "causal":
                _hide_future(st, rows, used)
            # numpy's four passes over token-major scores took 0.9 ms a layer at 4k
            totals = kvnative.turn_softmax(st)
            totals[totals == 0] = 1  # a query that sees nothing: zeros, as cpu_attention
            for part, weights in zip(values, _split(st, values), strict=True):
                part.values(head, weights, out[head])
            out[head, :used] /= totals[:used, None]

    _shared(attend, batch * kv_heads)
    return mx.array(out[:, :used].reshape(batch, heads, rows, dim))


def _shared(attend: Callable[[int, int], None], heads: int) -> None:
    """attend(0, heads), the heads split with the helper thread where the turn runs on
    two threads: the compiled calls let go of the GIL, so both run at once."""
    if heads < 2 or (cpu_blas.threads() or 1) < 2:
        attend(0, heads)
        return
    half = (heads + 1) // 2
    packed_rows.park_helpers()  # their waiting would take a core from these two threads
    helped = _helper().submit(attend, half, heads)
    attend(0, half)
    helped.result()


_executor: ThreadPoolExecutor | None = None
_making = threading.Lock()


def _helper() -> ThreadPoolExecutor:
    global _executor
    with _making:  # two threads' first turns at once make one helper, not two
        if _executor is None:
            _executor = ThreadPoolExecutor(1, thread_name_prefix="turn-attention")
        return _executor


def _forget_helper() -> None:
    """A forked child has no helper thread (nor any other thread to release the lock):
    its first shared turn starts its own."""
    global _executor, _making
    _executor, _making = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_helper)


def _spans(layout) -> list[tuple[bool, int, int]]:
    """(from the exact rows?, first, end) of every cached token in temporal order: the
    sink rows, the bulk, the tail; spans that hold nothing left out."""
    sink, exact = layout.sink_rows, len(layout.exact[0])
    spans = [(True, 0, sink), (False, layout.bulk_start, layout.bulk_end), (True, sink, exact)]
    return [span for span in spans if span[2] > span[1]]


class _Span:
    """A store's tokens [start, end) as numpy views of its buffers (batch x KV heads,
    tokens, width): float16 rows, or codes, scales and biases; their products with a
    KV head's queries."""

    def __init__(self, store, start: int, end: int) -> None:
        self.store = store
        views = (np.asarray(buffer)[:, :, store.span(start, end)] for buffer in store.buffers)
        self.parts = [v.reshape(v.shape[0] * v.shape[1], *v.shape[2:]) for v in views]
        self.heads, self.tokens = self.parts[0].shape[:2]

    def _rows(self, head: int) -> np.ndarray | kvnative.PackedTurnRows:
        """KV head `head`'s rows as the turn products take them."""
        if self.store.bits is None:
            return self.parts[0][head]
        return kvnative.PackedTurnRows(self.store.bits, *(part[head] for part in self.parts))

    def scores(self, head: int, qt: np.ndarray, st: np.ndarray) -> None:
        kvnative.turn_scores(self._rows(head), qt, st)

    def values(self, head: int, pt: np.ndarray, out: np.ndarray) -> None:
        kvnative.turn_values(self._rows(head), pt, out)


def _transposed(q: np.ndarray, scale: float) -> np.ndarray:
    """q (heads, queries, dim) scaled, as (heads, dim, queries padded to the tile)."""
    heads, used, dim = q.shape
    width = -(-used // kvnative.TURN_QUERIES) * kvnative.TURN_QUERIES
    qt = np.zeros((heads, dim, width), np.float32)
    np.multiply(q.transpose(0, 2, 1), np.float32(scale), out=qt[..., :used])
    return qt


def _split(st: np.ndarray, parts: list[_Span]) -> list[np.ndarray]:
    """A head's token-major scores cut into the spans `parts` hold."""
    ends = np.cumsum([part.tokens for part in parts])[:-1]
    return np.split(st, ends)


def _hide_future(st: np.ndarray, rows: int, used: int) -> None:
    """The causal mask on a head's token-major scores: the turn's own tokens are the
    last `rows`; query j (its row j % rows) sees those up to its own."""
    own = st[len(st) - rows :, :used]
    later = np.arange(rows)[:, None] > (np.arange(used) % rows)[None, :]
    own[later] = -np.inf
