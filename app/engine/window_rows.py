"""Sliding windows in checkpoints that share their rows with the checkpoints before them.

A checkpoint holds each sliding-window layer's window (app/engine/checkpoints.py),
and each of Llama 4's local layers' chunk: at a turn's end its last `max_size`
positions (up to `chunk_size`), most of which the checkpoint before holds already.
So a checkpoint written after another of the same conversation holds only the rows
of the positions from that one's end on (`cut`), and says so in its layout:
"rows": [first, end, held], the layer holds positions [end - held, end) and this
file those from `first`. A restore takes the rows before `first` from the
checkpoint that ends at `first`, and so on back (`fill`). A turn then writes its
own tokens' rows once, not the whole window again.

Rows are kept in position order. The app's windows and chunks (`MixedKVCache` with
a `max_size`, `ChunkedMixedKVCache`) and mlx-lm's `ChunkedKVCache` hold them so,
every position quantized in a quantized one, whose recent 16-bit rows go whole
into each checkpoint (a position's codes are the same whenever its 16-bit row is
quantized: app/engine/kvquant.py). mlx-lm's `RotatingKVCache` is a ring, turned to
position order for the file and back into the same slots (its `_idx`) on the way
in, so that the restored layer is the saved one slot for slot. A window that keeps
its first tokens (`keep`) is saved whole.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from sessions.cachefiles import CacheRejected

# How far back a restore follows checkpoints for the rows of one. A save writes its
# windows whole rather than make a chain longer (`checkpoints.save`): a window of
# thousands of tokens over turns of a few each would make every restore read as many
# files. (A file's layout names the positions it starts at: it cannot make a restore
# read without end.)
MAX_EARLIER = 64

_WINDOW_CLASSES = ("RotatingKVCache", "MixedKVCache", "ChunkedKVCache", "ChunkedMixedKVCache")

Earlier = Callable[[int], tuple[dict, str]]  # a checkpoint's (tensors, layout) by its end


@dataclass(frozen=True)
class _Rows:
    """Rows of consecutive positions a layer holds, ending at its offset: its tokens
    ("rows"), or a quantized window's recent 16-bit ones ("recent_rows"), which the
    layout names under `key`, held in the tensors `names` (keys and values, or their
    codes, scales and biases)."""

    key: str
    names: tuple[str, ...]


@dataclass(frozen=True)
class _Window:
    """A layer entry of a layout whose state is rows of positions."""

    entry: dict
    groups: tuple[_Rows, ...]
    offset: int  # its end: the positions it has seen
    ring: bool  # a `RotatingKVCache`: its rows in slots, `idx` the next one written

    @property
    def idx(self) -> int:
        return self.entry["items"][5][1]


def _parts(layout: list) -> Iterator[dict]:
    """Every layer entry of a layout, a CacheList's parts each."""
    for spec in layout:
        if isinstance(spec, dict) and isinstance(spec.get("parts"), list):
            yield from _parts(spec["parts"])
        elif isinstance(spec, dict):
            yield spec


def _value(items: list, n: int) -> object:
    item = items[n] if n < len(items) else None
    return item[1] if isinstance(item, list) and len(item) == 2 and item[0] == "value" else None


def _names(item: object) -> list[str] | None:
    """The tensor names of a state item that holds one array or several."""
    if not isinstance(item, list) or len(item) != 2:
        return None
    kind, value = item
    if kind == "array" and isinstance(value, str):
        return [value]
    if kind == "arrays" and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    return None


def _window(entry: dict) -> _Window | None:
    """The entry as a window of rows, or None for a layer saved whole (not a window, one
    that keeps its first tokens, or one this module can't read)."""
    items, name = entry.get("items"), entry.get("class")
    if not isinstance(items, list) or len(items) < 3:
        return None
    keys, values = _names(items[0]), _names(items[1])
    if not keys or not values:
        return None
    rows = _Rows("rows", (*keys, *values))
    if name == "RotatingKVCache" and len(items) == 6:
        offset, keep, idx = _value(items, 2), _value(items, 3), _value(items, 5)
        if type(offset) is int and keep == 0 and type(idx) is int and idx > 0:
            return _Window(entry, (rows,), offset, True)
    if name == "ChunkedKVCache" and len(items) == 5:  # Llama 4's local layers: their chunk
        offset = _value(items, 2)
        return _Window(entry, (rows,), offset, False) if type(offset) is int else None
    mixed = {"MixedKVCache": 11, "ChunkedMixedKVCache": 13}
    if mixed.get(name) == len(items) and len(keys) in (1, 3):
        # every token held in the bulk (16 bits, or codes, scales and biases), no sink (a
        # window that keeps none of its first tokens), the recent 16-bit rows apart
        no_sink = items[2] == items[3] == ["value", None]
        offset, max_size, keep = _value(items, 6), _value(items, 9), _value(items, 10)
        moves = type(max_size) is int or name == "ChunkedMixedKVCache"  # its front
        if no_sink and type(offset) is int and moves and keep == 0:
            recent_k, recent_v = _names(items[4]), _names(items[5])
            recent = _Rows("recent_rows", (*recent_k, *recent_v)) if recent_k and recent_v else None
            return _Window(entry, (rows, recent) if recent else (rows,), offset, False)
    return None


def _join(pieces: list) -> object:
    """Arrays joined along the tokens: numpy's where all are (a save, and a restore's
    files in host memory), mlx's otherwise."""
    if any(isinstance(piece, mx.array) for piece in pieces):
        return mx.concatenate([mx.array(p) if isinstance(p, np.ndarray) else p for p in pieces], 2)
    return np.concatenate(pieces, 2)


def _is_array(value: object) -> bool:
    return isinstance(value, mx.array | np.ndarray)


def _in_positions(window: _Window, tensors: dict) -> dict[str, int] | None:
    """A window's rows put in position order in `tensors` (a ring's taken out of its
    slots); how many each group holds, or None when its counts do not fit its rows."""
    arrays = [tensors.get(name) for group in window.groups for name in group.names]
    if not all(_is_array(a) and a.ndim == 4 for a in arrays):
        return None
    held = {group.key: tensors[group.names[0]].shape[2] for group in window.groups}
    if not window.ring:
        return held if all(n <= window.offset for n in held.values()) else None
    (names,), idx, ring_size = [g.names for g in window.groups], window.idx, held["rows"]
    if window.offset >= ring_size and 0 < idx <= ring_size:
        for name in names:
            tensors[name] = _join([tensors[name][:, :, idx:], tensors[name][:, :, :idx]])
        return held
    if idx == window.offset <= ring_size:  # not full yet: the slots after it are unused
        for name in names:
            tensors[name] = tensors[name][:, :, : window.offset]
        return {"rows": window.offset}
    return None


def cut(
    tensors: dict[str, np.ndarray], layout_json: str, since: int
) -> tuple[dict, str, int | None]:
    """A checkpoint's snapshot (`snapshots.snapshot`) with its windows' rows in position
    order, those before `since` left out (the checkpoint ending at `since` holds them);
    and the first position whose rows it needs, from itself or the ones before (None
    when it has no such window)."""
    layout = json.loads(layout_json)
    tensors = dict(tensors)
    needs_from = None
    for entry in _parts(layout):
        window = _window(entry)
        held = _in_positions(window, tensors) if window else None
        for group in window.groups if held else ():
            first, end = window.offset - held[group.key], window.offset
            kept_from = max(first, min(since, end))
            for name in group.names:
                tensors[name] = np.ascontiguousarray(tensors[name][:, :, kept_from - first :])
            entry[group.key] = [kept_from, end, held[group.key]]
            needs_from = first if needs_from is None else min(needs_from, first)
    return tensors, json.dumps(layout), needs_from


def fill(tensors: dict, layout_json: str, earlier: Earlier) -> tuple[dict, str]:
    """A checkpoint read from its file, its windows' rows completed from the checkpoints
    before it (`earlier(end)`: the one ending at `end`) and a ring's put back in its
    slots: the snapshot `snapshots.restore_checkpoint` takes, once in mlx. Arrays in
    host memory (numpy) or mlx's, all of one kind: a restore joins a chain's rows in
    host memory and hands mlx the result once. `CacheRejected` when the rows do not
    add up."""
    try:
        layout = json.loads(layout_json)
        parts = list(_parts(layout)) if isinstance(layout, list) else []
    except (ValueError, RecursionError) as exc:  # a file's: any text at all
        raise CacheRejected("unreadable snapshot layout") from exc
    tensors, short = dict(tensors), {}
    for i, entry in enumerate(parts):
        # (other classes, and a window saved whole, are for `restore_checkpoint`)
        if "rows" in entry and entry.get("class") in _WINDOW_CLASSES:
            window = _window(entry)
            if window is None:
                raise CacheRejected("a window's rows that no window holds")
            for group in window.groups:
                first, start = _own_rows(window, group, entry, tensors)
                short[i, group.key] = (window, group, first, start)
    if not short:
        return tensors, layout_json
    _take_earlier(short, tensors, earlier, len(parts))
    for window, *_ in short.values():
        if window.ring:
            _into_slots(window, tensors)
    return tensors, json.dumps(layout)


def _own_rows(window: _Window, group: _Rows, entry: dict, tensors: dict) -> tuple:
    """(first, needed from) of the rows of `group` a checkpoint's own file holds: as its
    layout says (taken out of it), or all it holds where it says nothing (a quantized
    window's recent rows, saved whole)."""
    rows = entry.pop(group.key, None)
    if rows is None and group.key == "recent_rows":
        held = tensors[group.names[0]].shape[2] if group.names[0] in tensors else -1
        rows = [window.offset - held, window.offset, held]
    first = _checked_rows(window, group, rows, tensors)
    return first, rows[1] - rows[2]


def _checked_rows(window: _Window | None, group: _Rows, rows: object, tensors: dict) -> int:
    """The first position a window's own rows of `group` hold, checked against its
    counts and its arrays."""
    if window is None or not isinstance(rows, list) or len(rows) != 3:
        raise CacheRejected("a window's rows that no window holds")
    if not all(type(n) is int and 0 <= n < 2**31 for n in rows):
        raise CacheRejected("a window's rows that are not counts")
    first, end, held = rows
    if end != window.offset or not 0 <= end - held <= first <= end:
        raise CacheRejected("a window's rows outside its positions")
    if window.ring and window.idx > held:
        raise CacheRejected("a window's ring position outside its rows")
    for name in group.names:
        array = tensors.get(name)
        if not _is_array(array) or array.ndim != 4 or array.shape[2] != end - first:
            raise CacheRejected(f"a window's rows of the wrong length in {name}")
    return first


def _take_earlier(short: dict, tensors: dict, earlier: Earlier, count: int) -> None:
    """Each window's rows before its own first position (`short`: by the entry's place
    in the layout and the group, the window, the group, its first position and the one
    it needs), from the checkpoints ending there, latest first, until every window
    holds its rows. Each tensor's pieces are joined once, at the end: prepended one by
    one, a window over many short turns would be copied as many times."""
    pieces: dict[str, list] = {}  # latest first
    for _ in range(MAX_EARLIER):
        needing = {at: item for at, item in short.items() if item[2] > item[3]}
        if not needing:
            for name, earlier_rows in pieces.items():
                tensors[name] = _join([*earlier_rows[::-1], tensors[name]])
            return
        at = max(first for _, _, first, _ in needing.values())
        before_tensors, before_json = earlier(at)
        try:
            before = list(_parts(json.loads(before_json)))
        except (ValueError, TypeError, RecursionError) as exc:
            raise CacheRejected("unreadable snapshot layout") from exc
        if len(before) != count:
            raise CacheRejected("the checkpoint before holds other layers")
        for (i, key), (window, group, first, start) in needing.items():
            if first == at:
                older = _older_rows(window, group, before[i], before_tensors, at)
                taken_from = _prepend(group, older, tensors, (start, at), pieces)
                short[i, key] = (window, group, taken_from, start)
    raise CacheRejected("a window's rows go back too far")


def _older_rows(
    window: _Window, group: _Rows, entry: dict, tensors: dict, at: int
) -> tuple[int, dict]:
    """(first position, tensors) of the rows of `group` that the checkpoint before, the
    one ending `at`, holds in `entry`: as its layout says, or, in one saved whole before
    checkpoints shared their rows, all it holds (a ring's taken out of its slots)."""
    older = _window(entry)
    if older is None or older.ring != window.ring or older.groups != window.groups:
        raise CacheRejected("the checkpoint before holds other windows")
    if older.offset != at:  # its file says another end than its key and index row do
        raise CacheRejected("the checkpoint before holds a window that ends elsewhere")
    if "rows" not in entry:
        held = _in_positions(older, tensors)
        if held is None or held.keys() != {g.key for g in older.groups}:
            raise CacheRejected("the checkpoint before holds a window that does not add up")
        for key, n in held.items():
            entry[key] = [older.offset - n, older.offset, n]
    first = _checked_rows(older, group, entry.get(group.key), tensors)
    return first, tensors


def _prepend(
    group: _Rows, older: tuple[int, dict], tensors: dict, span: tuple, pieces: dict
) -> int:
    """The rows of positions [start, at) that the checkpoint before holds from `first`
    on, added to the `pieces` that go before the window's own in `tensors`; the first
    position it now holds."""
    (start, at), (first, before) = span, older
    if first >= at:
        raise CacheRejected("the checkpoint before holds none of the rows needed")
    taken_from = max(first, start)
    for name in group.names:
        piece, own = before[name][:, :, taken_from - first :], tensors[name]
        if not _is_array(piece) or type(piece) is not type(own) or piece.dtype != own.dtype:
            raise CacheRejected("the checkpoint before holds rows of another kind")
        if piece.shape[:2] + piece.shape[3:] != own.shape[:2] + own.shape[3:]:
            raise CacheRejected("the checkpoint before holds rows of another shape")
        pieces.setdefault(name, []).append(piece)
    return taken_from


def _into_slots(window: _Window, tensors: dict) -> None:
    """A ring's rows, in position order, back in the slots it held them in: the
    position before `idx` in the slot before it."""
    for name in window.groups[0].names:
        rows = tensors[name]
        turn = rows.shape[2] - window.idx
        tensors[name] = _join([rows[:, :, turn:], rows[:, :, :turn]])
