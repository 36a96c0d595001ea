"""The next token's logits from the last row only.

Why: a turn's first call feeds the new message's tokens (up to `steps.SHORT_PROMPT`)
and samples from the last row's logits, but mlx-lm's models project every row onto
the vocabulary, and mlx does not move the slice `[:, -1]` before the product. For
the starter (49k tokens, 576 wide) a 17-token follow-up spent about 10 ms of its
first call on 16 rows of logits nobody read; for a 151k-token vocabulary 2,048 wide,
64 rows are 20 G multiply-adds.

How: the model's backbone (`model.model`, or `model.language_model.model`: where
mlx-lm's text models keep the layers and final norm) gets a subclass whose call,
inside `only_last_row(model)`, returns its last row. The head that follows works
row by row (a projection, a scale, a soft cap), so its one row is the row the full
call would have given. Outside the context, and in models built another way, every
row is computed as before (perplexity needs them all).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import mlx.core as mx
import mlx.nn as nn

_SUBCLASSES: dict[type, type] = {}
# Per thread: how many `only_last_row` contexts are open, by backbone (a model shared
# with another thread keeps giving that thread every row).
_open = threading.local()


def _depths() -> dict[int, int]:
    if not hasattr(_open, "depths"):
        _open.depths = {}
    return _open.depths


def _subclass(backbone_class: type) -> type:
    if backbone_class not in _SUBCLASSES:

        def call(self, *args, **kwargs):
            out = backbone_class.__call__(self, *args, **kwargs)
            if _depths().get(id(self)) and isinstance(out, mx.array) and out.ndim == 3:
                return out[:, -1:]
            return out

        name = f"LastRow{backbone_class.__name__}"
        _SUBCLASSES[backbone_class] = type(name, (backbone_class,), {"__call__": call})
    return _SUBCLASSES[backbone_class]


def _backbone(model: nn.Module) -> nn.Module | None:
    """`model.model`, or that of `model.language_model` (Llama 4, vision wrappers)."""
    for name in ("model", "language_model"):
        child = model.get(name) if isinstance(model, dict) else None
        if isinstance(child, nn.Module):
            return child if name == "model" else _backbone(child)
    return None


def install(model: nn.Module) -> bool:
    """Give `model`'s backbone the last-row call; False where it has none known."""
    backbone = _backbone(model)
    if backbone is None:
        return False
    if type(backbone) not in _SUBCLASSES.values():
        backbone.__class__ = _subclass(type(backbone))
    return True


@contextlib.contextmanager
def only_last_row(model: nn.Module) -> Iterator[None]:
    """Calls of `model` on this thread inside give the last row's logits only (shape
    (batch, 1, vocab)) where `install` found its backbone; elsewhere all rows."""
    backbone = _backbone(model)
    if type(backbone) not in _SUBCLASSES.values():
        yield
        return
    depths, key = _depths(), id(backbone)
    depths[key] = depths.get(key, 0) + 1
    try:
        yield
    finally:
        depths[key] -= 1
