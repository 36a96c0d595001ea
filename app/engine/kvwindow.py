"""The 16-bit window of the app's quantized KV caches (app/engine/kvquant.py): which of a
layer's tokens are held quantized, and which still in 16 bits, at a given count.

The rule is a function of the count alone, however the tokens arrived (a long prefill,
a decode step at a time, a restore from files), so that a cache rebuilt from its files
is the live one, and a reader of a file knows what its 16-bit copy must hold.
"""

from __future__ import annotations

import re
from dataclasses import replace
from functools import cache

from app.engine.kvscheme import APP_SCHEMES, KVScheme

FLUSH = 32  # tokens quantized at a time once older than the window


def quantized_at(count: int, window: int, scheme: KVScheme) -> int:
    """How many positions a layer of `scheme` holds quantized once `count` are stored:
    whole blocks (`flush_block`) of tokens older than the window. A function of the
    count alone, however the tokens arrived, so a cache rebuilt from its files is the
    live one."""
    block = flush_block(scheme)
    return max(0, (count - window) // block * block)


def flush_block(scheme: KVScheme) -> int:
    """Tokens quantized at a time: FLUSH, or one where both halves stay 16-bit
    (`SIXTEEN_BIT`, the CPU path's 16 bits). Its "quantizing" is a copy, so a token
    goes to the bulk at once: the layer never holds a second copy of its recent rows,
    and a save never writes one."""
    return 1 if scheme.key_bits is None and scheme.value_bits is None else FLUSH


@cache
def app_window(scheme: KVScheme) -> int:
    """The 16-bit window the app runs `scheme` with: a saved format does not name it
    (it is a setting of the app's 8-bit and 4-bit, the same for every group size).
    Asked for each run of layers of each chunk a restore reads: found once a scheme."""
    for app_scheme in APP_SCHEMES.values():
        if replace(app_scheme, group_size=scheme.group_size, window=0) == replace(scheme, window=0):
            return app_scheme.window
    return scheme.window


def tail_rows_at(count: int, scheme: KVScheme) -> int:
    """How many 16-bit rows after the sink a layer holds at `count` tokens."""
    window = app_window(scheme)
    return max(0, count - max(quantized_at(count, window, scheme), scheme.sink))


def tail_start_at(count: int, scheme: KVScheme) -> int:
    """The first position after the sink a layer of `scheme` holds in 16 bits at `count`
    tokens (`count` when it holds none)."""
    return count - tail_rows_at(count, scheme)


# A chunk's 16-bit copy of positions [first, end) ("r96-160k": keys; end is the chunk's
# own); and the one copy format 4 files held, before each chunk carried its own: the
# save's last chunk's "t<end>k", positions [tail_start_at(end), end).
_COPY = re.compile(r"r(0|[1-9]\d{0,8})-(0|[1-9]\d{0,8})([kv])")
_LAST_COPY = re.compile(r"t(0|[1-9]\d{0,8})([kv])")


def copy_name(first: int, end: int, part: str) -> str:
    """The name of the 16-bit copy of positions [first, end) of `part` ("k" or "v")."""
    return f"r{first}-{end}{part}"


def copy_span(name: str, scheme: KVScheme) -> tuple[int, int, str] | None:
    """(first, end, part) of the positions a 16-bit copy named `name` holds; None when
    `name` is not one."""
    if match := _COPY.fullmatch(name):
        return int(match[1]), int(match[2]), match[3]
    if match := _LAST_COPY.fullmatch(name):
        end = int(match[1])
        return tail_start_at(end, scheme), end, match[2]
    return None


def covering_copies(
    copies: list[tuple[int, int]], start: int, end: int
) -> list[tuple[int, int, int]] | None:
    """Which 16-bit copies give positions [start, end): `copies` are (first, end) each,
    in their chunks' order, and a later one's rows stand for an earlier one's (a save
    after a cut writes its whole tail again: its rows then hold dequantized values).
    Per copy used, in order of position, (its index, from, to); None where a position
    has no copy."""
    picks, low = [], end
    for i in range(len(copies) - 1, -1, -1):
        if low <= start:
            break
        first, stop = copies[i]
        if stop < low:  # the copies before end sooner still
            return None
        if first < low:
            picks.append((i, max(first, start), low))
            low = max(first, start)
    return picks[::-1] if low <= start else None
