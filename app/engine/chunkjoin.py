"""A restore's chunks, checked one by one as they are read, joined into layers once.

Every chunk file's tensors are checked against what its layers' codecs say a
chunk of its span must hold (app/engine/codecs.py), per run of alike layers
(app/engine/layer_runs.py) rather than per layer, and kept in token order per
run. The join then builds each run's layers at once, from one buffer per tensor.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import trim_prompt_cache

from app.engine.codecs import CODECS, LayerShape, TensorSpec, check_run
from app.engine.layer_runs import Run, label, single_layers, split_runs
from app.engine.stored_arrays import as_mlx, empty_layers, from_stored
from app.engine.tokenstore import joined, layer_rows
from sessions.cachefiles import CacheRejected


class ChunkJoin:
    """The chunks of one restore, for a model whose layers cache `shapes` (None for
    a layer that is not plain attention), saved as `fmt`."""

    def __init__(self, shapes: list[LayerShape | None], fmt: str, tokens: int) -> None:
        """`tokens`: how many the chunks hold together, from the first on (their spans
        follow one another: `KVStore.saved_chunks` checks)."""
        self.shapes, self.fmt, self.tokens = shapes, fmt, tokens
        self.classes: list[str | None] | None = None
        self.pieces: dict[Run, dict[str, list]] = {}
        self.placed: dict[tuple[int, str], tuple[mx.array, np.ndarray]] = {}

    def add(self, tensors: dict, classes: list[str | None], span: tuple[int, int]) -> None:
        """A chunk's tensors of tokens `span`, its layers of `classes`, checked and
        appended to each run's pieces; tensors read into host memory and joined over
        the chunks are copied into their layers' buffers at once (`_place`)."""
        if self.classes not in (None, classes):
            raise CacheRejected("chunks disagree on their layers' classes")
        self.classes = classes
        runs = split_runs(tensors, len(self.shapes))
        self._check_layers(runs, classes)
        if self.pieces and runs.keys() != self.pieces.keys():
            # Chunks of formats 3 and 4 in one conversation: join them layer by layer.
            runs, self.pieces = single_layers(runs), single_layers_of(self.pieces)
        specs: dict[tuple, dict[str, TensorSpec]] = {}  # alike runs share theirs
        for run, named in runs.items():
            what = (classes[run[0]], self.shapes[run[0]], frozenset(named))
            if what not in specs:
                specs[what] = CODECS[what[0]].specs(what[1], self.fmt, *span, what[2])
            previous = {name: p[-1] for name, p in self.pieces.get(run, {}).items()}
            check_run(run, named, specs[what], previous)
        for run, named in runs.items():
            kept = self.pieces.setdefault(run, {})
            codec = CODECS[classes[run[0]]]
            for name, array in named.items():
                if isinstance(array, np.ndarray) and codec.joins(name) and _worth_placing(array):
                    self._place(run, name, array, span[0], codec.capacity(self.tokens))
                    # what the checks and the build read of it: its shape and type
                    array = np.broadcast_to(np.zeros((), array.dtype), array.shape)
                elif isinstance(array, np.ndarray):  # a view would hold its whole file
                    array = mx.array(array)  # a copy, and the one mlx builds from
                kept.setdefault(name, []).append(array)

    def _place(self, run: Run, name: str, array: np.ndarray, start: int, capacity: int) -> None:
        """A chunk's tensor (layers first, tokens on axis 3) copied into each layer's
        buffer from token `start` on; a layer's buffer made at its first chunk, with
        zero rows up to `capacity` tokens (`stored_arrays.empty_layers`). The chunk's
        memory can go as soon as this returns: a restore never holds a second copy of
        the cache."""
        first, last = run
        missing = [i for i in range(first, last + 1) if (i, name) not in self.placed]
        if missing:
            layers = empty_layers(len(missing), array.shape[1:], capacity, array.dtype)
            self.placed |= {(i, name): layer for i, layer in zip(missing, layers, strict=True)}
        end = start + array.shape[3]
        for i in range(first, last + 1):
            np.copyto(self.placed[i, name][1][..., start:end, :], array[i - first])

    def _check_layers(self, runs: dict[Run, dict], classes: list[str | None]) -> None:
        """Each layer of a class is in one run of layers alike in class and shape, and
        no other layer is."""
        held = [None] * len(self.shapes)
        for first, last in runs:
            for i in range(first, last + 1):
                if classes[i] is None:  # a layer a checkpoint holds
                    raise CacheRejected(f"layer {i} has tensors its chunks do not hold")
                if self.shapes[i] is None:
                    raise CacheRejected(f"layer {i} of this model is not plain attention")
                if (classes[i], self.shapes[i]) != (classes[first], self.shapes[first]):
                    raise CacheRejected(f"{label((first, last))} are not alike")
                held[i] = classes[i]
        for i, (name, have) in enumerate(zip(classes, held, strict=True)):
            if name != have:
                raise CacheRejected(f"layer {i} has the wrong tensors")

    def build(self, overshoot: int) -> list:
        """Each chunked layer joined from its pieces, cut back by the `overshoot` tokens
        its last chunk holds past the restore's end; None for the others."""
        cache: list = [None] * len(self.shapes)
        for (first, last), named in self.pieces.items():
            codec = CODECS[self.classes[first]]
            count = sum(piece.shape[3] for piece in named["k.0"])
            capacity = codec.capacity(count)
            joined = {
                name: self._joined((first, last), name, parts, capacity)
                if codec.joins(name)
                else as_mlx(parts[0])
                for name, parts in named.items()
            }
            # back to the type the model computes in
            cache[first : last + 1] = codec.build(joined, count, self.fmt, self.shapes[first].dtype)
        built = [
            (CODECS[name], layer)
            for name, layer in zip(self.classes, cache, strict=True)
            if layer is not None
        ]
        if overshoot:
            trim_prompt_cache([layer for _, layer in built], overshoot)
        mx.eval([array for codec, layer in built for array in codec.arrays(layer)])
        return cache

    def _joined(self, run: Run, name: str, pieces: list, capacity: int) -> list[mx.array]:
        """A tensor of a run's layers joined over the chunks, an array per layer with
        zero rows after its tokens up to `capacity`: read into host memory, each layer's
        own buffer, filled as the chunks came (`_place`); in mlx memory (the GPU's),
        joined there, each layer a view of the run's buffer (the first token after the
        restore copies it, at the GPU's speed)."""
        if (run[0], name) in self.placed:
            return [from_stored(self.placed[i, name][0]) for i in range(run[0], run[1] + 1)]
        pieces = [mx.array(p) if isinstance(p, np.ndarray) else p for p in pieces]
        return layer_rows(from_stored(joined(pieces, capacity)))


# Bytes a token of one layer's tensor must hold to be copied into each layer's own
# buffer as its chunk is read. A group's scales or biases hold a few (2 to 8 a head):
# copying each chunk into thirty buffers costs more in calls than in bytes, so they
# are joined at the build instead, each layer a view of its run's buffer (a view's
# first update copies it: a few kB).
_PLACED_BYTES_PER_TOKEN = 64


def _worth_placing(array: np.ndarray) -> bool:
    """Whether a chunk's tensor (layers first, tokens on axis 3) goes into each layer's
    own buffer as it is read (`ChunkJoin._place`) rather than joined at the build."""
    heads, width = array.shape[2], array.shape[4]
    return heads * width * array.itemsize >= _PLACED_BYTES_PER_TOKEN


def single_layers_of(pieces: dict[Run, dict[str, list]]) -> dict[Run, dict[str, list]]:
    """Each run's pieces as runs of one layer (`single_layers`), chunk by chunk."""
    split: dict[Run, dict[str, list]] = {}
    for run, named in pieces.items():
        for name, chunks in named.items():
            for chunk in chunks:
                for layer, one in single_layers({run: {name: chunk}}).items():
                    split.setdefault(layer, {}).setdefault(name, []).append(one[name])
    return split
