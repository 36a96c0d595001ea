"""Which of a conversation's checkpoints hold the window rows of which.

A checkpoint whose windows hold only the rows since the checkpoint before it
(app/engine/window_rows.py) needs that one, and the ones before it, back to the
first position its windows hold. Its index row says both: `rows_from`, where its
own rows begin (the end of the one before it), and `token_start`, the first
position it needs. A conversation's checkpoints are written one after another,
so the one a checkpoint takes rows from is the one that ends where its own rows
begin; a chain with a checkpoint missing (evicted, found damaged, another chat's)
cannot be restored, and nothing is built on it.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.engine import window_rows

# Checkpoints a conversation can go on from: the ends of its last turns, so that an
# edit or a regenerate resumes from the one before the change; an edit further back
# recomputes.
MAX_CHECKPOINTS = 4


@dataclass(frozen=True)
class Point:
    """A saved checkpoint, as its index row has it."""

    key: str
    end: int  # the tokens it holds
    needs_from: int  # the first position whose rows it needs (0 in one saved before)
    rows_from: int | None  # where its own rows begin; None: all it needs is its own

    @classmethod
    def of(cls, key: str, row: dict) -> Point:
        return cls(key, row["token_end"], row["token_start"], row["rows_from"])

    @property
    def whole(self) -> bool:
        """Whether it holds every row it needs."""
        return self.rows_from is None or self.rows_from <= self.needs_from


def chain(point: Point, points: list[Point]) -> list[Point] | None:
    """`point` and those of `points` it takes rows from, latest first; None when one is
    not among them, or when there would be more than a restore reads
    (`window_rows.MAX_EARLIER`)."""
    by_end = {p.end: p for p in points}
    found = [point]
    while not found[-1].whole and found[-1].rows_from > point.needs_from:
        before = by_end.get(found[-1].rows_from)
        if before is None or len(found) > window_rows.MAX_EARLIER:
            return None
        found.append(before)
    return found


def parent(points: list[Point]) -> Point | None:
    """The checkpoint a new one after `points` (a conversation's, oldest first) takes the
    rows before its own from: the last, when its own chain is whole and leaves room for
    one more; None, and the new one holds its windows whole."""
    if not points:
        return None
    found = chain(points[-1], points)
    return points[-1] if found is not None and len(found) < window_rows.MAX_EARLIER else None


def kept(points: list[Point]) -> list[Point]:
    """The checkpoints a conversation keeps, oldest first: the last MAX_CHECKPOINTS,
    where a turn can go on from, and the ones before them that hold rows they need."""
    resumable = points[-MAX_CHECKPOINTS:]
    needed = {p.key for point in resumable for p in chain(point, points) or [point]}
    return [point for point in points if point.key in needed]
