"""Runs of layers in chunk files: one tensor per part for many layers.

A chunk file of format 4 stacks consecutive layers of one class whose tensors
agree in name, shape and dtype (every layer of most models) along a new first
axis, named "<first>-<last>.<tensor>": a 4-bit chunk of a 30-layer model holds
6 tensors instead of 180 (the first and the last chunk 2 or 4 more, its 16-bit
rows). Reading, checking and joining a chunk costs per tensor, so a small cache
restored at the speed of its bytes needs few of them.
Format 3 files hold one tensor per layer ("<layer>.<tensor>"); they are read
as runs of one layer.
"""

from __future__ import annotations

import itertools
import re

import numpy as np

from sessions.cachefiles import CacheRejected

Run = tuple[int, int]  # its first and last layer

_SPAN = re.compile(r"(0|[1-9]\d{0,8})(?:-(0|[1-9]\d{0,8}))?")


def stack_runs(layers: list[tuple[int, str, dict[str, np.ndarray]]]) -> dict[str, np.ndarray]:
    """The tensors of a chunk file from each layer's (index, class, tensors), in layer
    order: consecutive layers of one class with alike tensors stacked into one run."""
    tensors: dict[str, np.ndarray] = {}
    run: list = []
    for layer in layers:
        if run and not _continues(run[-1], layer):
            tensors |= _stacked(run)
            run = []
        run.append(layer)
    if run:
        tensors |= _stacked(run)
    return tensors


def _continues(previous: tuple, layer: tuple) -> bool:
    (i, cls, named), (j, other, more) = previous, layer
    return (
        j == i + 1
        and cls == other
        and named.keys() == more.keys()
        and all(named[n].shape == more[n].shape and named[n].dtype == more[n].dtype for n in named)
    )


def _stacked(run: list) -> dict[str, np.ndarray]:
    span = f"{run[0][0]}-{run[-1][0]}"
    return {f"{span}.{name}": np.stack([named[name] for _, _, named in run]) for name in run[0][2]}


def split_runs(tensors: dict, layers: int) -> dict[Run, dict]:
    """A chunk file's tensors per run of layers, each with the layers along its first
    axis (a format 3 tensor of one layer gets that axis); refuses a name that is not
    "<first>-<last>.<tensor>" or "<layer>.<tensor>" of the model's `layers`, and runs
    that overlap."""
    runs: dict[Run, dict] = {}
    for full_name, array in tensors.items():
        span, _, name = full_name.partition(".")
        match = _SPAN.fullmatch(span)
        run = match and (int(match[1]), int(match[2] or match[1]))
        if not run or not run[0] <= run[1] < layers or not name or name in runs.get(run, {}):
            raise CacheRejected(f"unexpected tensor {full_name[:80]!r}")
        runs.setdefault(run, {})[name] = array if match[2] else array[None]
    ordered = sorted(runs)
    for before, after in itertools.pairwise(ordered):
        if after[0] <= before[1]:
            raise CacheRejected(f"layers {after[0]}-{before[1]} are in two runs")
    return runs


def single_layers(runs: dict[Run, dict]) -> dict[Run, dict]:
    """The same tensors as runs of one layer each (to join chunks whose runs differ:
    files of formats 3 and 4 in one conversation)."""
    return {
        (i, i): {name: array[i - first : i - first + 1] for name, array in named.items()}
        for (first, last), named in runs.items()
        for i in range(first, last + 1)
    }


def label(run: Run) -> str:
    """ "layer 3", "layers 0-29"."""
    return f"layer {run[0]}" if run[0] == run[1] else f"layers {run[0]}-{run[1]}"
