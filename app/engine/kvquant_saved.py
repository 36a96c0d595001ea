"""A `MixedKVCache` saved and built back: its whole state for a snapshot, and the
tensors of a span of its tokens for a chunk file (app/engine/codecs.py).

Every token is saved quantized, with the codes the live layer holds; the 16-bit
sink goes with the first chunk, and each chunk carries a 16-bit copy of its own
positions in the layer's recent window ("r<first>-<end>k", app/engine/recent_copies.py
says which copies stay on disk). A layer built from its chunks takes the window from
those copies, the later ones standing for the earlier (`kvwindow.covering_copies`),
so that it is the live layer, and quantizes what leaves its window as the live one does.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import mlx.core as mx

from app.engine.kvscheme import KVScheme, parse_format
from app.engine.kvwindow import (
    app_window,
    copy_name,
    copy_span,
    covering_copies,
    quantized_at,
    tail_rows_at,
    tail_start_at,
)
from app.engine.tokenstore import joined, layer_rows

if TYPE_CHECKING:
    from app.engine.kvquant import MixedKVCache


class SavedLayer:
    """The saving and rebuilding half of `MixedKVCache` (its base class)."""

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
