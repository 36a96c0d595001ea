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
from app.engine.stored_arrays import as_mlx, from_stored, joined_on_host
from app.engine.tokenstore import joined, layer_rows
from sessions.cachefiles import CacheRejected


class ChunkJoin:
    """The chunks of one restore, for a model whose layers cache `shapes` (None for
    a layer that is not plain attention), saved as `fmt`."""

    def __init__(self, shapes: list[LayerShape | None], fmt: str) -> None:
        self.shapes, self.fmt = shapes, fmt
        self.classes: list[str | None] | None = None
        self.pieces: dict[Run, dict[str, list[mx.array]]] = {}

    def add(self, tensors: dict, classes: list[str | None], span: tuple[int, int]) -> None:
        """A chunk's tensors of tokens `span`, its layers of `classes`, checked and
        appended to each run's pieces."""
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
            what = (classes[run[0]], self.shapes[run[0]])
            if what not in specs:
                specs[what] = CODECS[what[0]].specs(what[1], self.fmt, *span)
            previous = {name: p[-1] for name, p in self.pieces.get(run, {}).items()}
            check_run(run, named, specs[what], previous)
        for run, named in runs.items():
            kept = self.pieces.setdefault(run, {})
            for name, array in named.items():
                kept.setdefault(name, []).append(array)

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
                name: _joined(parts, capacity) if codec.joins(name) else as_mlx(parts[0])
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


def _joined(pieces: list, capacity: int) -> list[mx.array]:
    """A tensor's pieces, one a chunk (layers first, tokens on axis 3), as an array per
    layer with zero rows after them up to `capacity` tokens: read into host memory,
    each layer's its own buffer (`joined_on_host`); already in mlx memory (the GPU's),
    joined there, each layer a view of the run's buffer (the first token after the
    restore copies it, at the GPU's speed)."""
    if isinstance(pieces[0], np.ndarray):
        return joined_on_host(pieces, capacity)
    return layer_rows(from_stored(joined(pieces, capacity)))


def single_layers_of(pieces: dict[Run, dict[str, list]]) -> dict[Run, dict[str, list]]:
    """Each run's pieces as runs of one layer (`single_layers`), chunk by chunk."""
    split: dict[Run, dict[str, list]] = {}
    for run, named in pieces.items():
        for name, chunks in named.items():
            for chunk in chunks:
                for layer, one in single_layers({run: {name: chunk}}).items():
                    split.setdefault(layer, {}).setdefault(name, []).append(one[name])
    return split
