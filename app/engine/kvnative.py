"""The compiled products of the CPU path's packed-cache attention (kvdecode.c).

kvcpu calls `attend` for a decode step's layer, every KV head at once, on numpy
views of the cache's own buffers. Every pointer and stride handed to C is taken
from a numpy array here, after the checks in `fits` (which `attend` makes on
every call), so the library reads only what those arrays hold. Where the
library was not built (no C compiler at install) or `REPRISE_KV_NATIVE=off`,
`available()` is False and kvcpu keeps its numpy code.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

_INT, _SIZE, _FLOAT_P, _P = ctypes.c_int, ctypes.c_ssize_t, ctypes.c_void_p, ctypes.c_void_p

enabled = os.environ.get("REPRISE_KV_NATIVE", "on") != "off"
ABI = 5  # kvdecode.c's REPRISE_KV_ABI: the arguments the calls below pass
_library: ctypes.CDLL | None = None
_tried = False


def _load() -> ctypes.CDLL | None:
    global _library, _tried
    if not _tried:
        _tried = True
        try:
            from app.engine import _kvdecode
        except ImportError:
            return None
        _library = _open(_kvdecode.__file__)
    return _library


def _open(path: str) -> ctypes.CDLL | None:
    """The library at `path` with its functions' C types, and its limits read once
    (`limits`: row width, queries, groups, lanes), as every call checks them; None
    where it was built for other arguments than these (`ABI`)."""
    library = ctypes.CDLL(path)
    library.reprise_kv_limit.argtypes, library.reprise_kv_limit.restype = [_INT], _INT
    if library.reprise_kv_limit(4) != ABI:
        return None
    library.reprise_kv_attend.argtypes = [_P, _INT, _FLOAT_P, _FLOAT_P, _INT, _INT, _FLOAT_P]
    library.reprise_kv_attend.restype = _INT
    library.reprise_kv_widen_halves.argtypes = [_P, _SIZE, _SIZE, _SIZE, _FLOAT_P]
    library.reprise_kv_widen_halves.restype = None
    library.reprise_turn_scores.argtypes = [_P, _SIZE, _INT, _INT, _FLOAT_P, _INT, _FLOAT_P]
    library.reprise_turn_values.argtypes = [_P, _SIZE, _INT, _INT, _FLOAT_P, _INT, _INT, _FLOAT_P]
    library.reprise_turn_softmax.argtypes = [_FLOAT_P, _INT, _INT, _FLOAT_P]
    library.reprise_turn_scores.restype = library.reprise_turn_values.restype = None
    packed = [_P, _SIZE, _P, _P, _SIZE, _INT, _INT, _INT, _INT, _FLOAT_P, _INT]
    library.reprise_turn_scores_packed.argtypes = [*packed, _FLOAT_P]
    library.reprise_turn_values_packed.argtypes = [*packed, _INT, _FLOAT_P]
    library.reprise_turn_scores_packed.restype = None
    library.reprise_turn_values_packed.restype = None
    library.reprise_turn_softmax.restype = None
    library.reprise_turn_limit.argtypes, library.reprise_turn_limit.restype = [_INT], _INT
    library.turn_limits = tuple(library.reprise_turn_limit(which) for which in range(2))
    library.reprise_turn_fast.argtypes, library.reprise_turn_fast.restype = [], _INT
    library.turn_fast = bool(library.reprise_turn_fast())  # asked once: every turn's layers ask
    library.limits = tuple(library.reprise_kv_limit(which) for which in range(4))
    return library


def available() -> bool:
    return enabled and _load() is not None


class Rows:
    """One store's tokens of every KV head, as the C reads them: `parts` are numpy
    views (heads, tokens, width) of its codes, scales and biases (quantized), or of
    its float16 rows."""

    def __init__(self, bits: int | None, parts: list[np.ndarray]) -> None:
        self.bits = bits or 16
        self.codes = parts[0]
        self.scales, self.biases = (parts[1], parts[2]) if bits else (None, None)
        self.groups = 1 if bits is None else parts[1].shape[-1]
        self.dim = self.codes.shape[-1] * self.codes.itemsize * 8 // self.bits
        self.tokens = self.codes.shape[1]
        self._readable: bool | None = None  # worked out by the first `fits`

    def fits(self, queries: int) -> bool:
        """Whether the C takes these rows for `queries` queries a KV head: its limits,
        whole lanes per group, a width it reads (4 or 8 bits with scales, float16 rows
        without), each token's codes (and scales) contiguous, biases laid out as the
        scales. The rows are looked at once; `attend` asks on every call."""
        library = _load()
        if library is None:
            return False
        if self._readable is None:
            self._readable = self._shapes_fit(library.limits) and self._laid_out()
        return self._readable and 0 < queries <= library.limits[1]

    def _shapes_fit(self, limits: tuple[int, ...]) -> bool:
        max_dim, _, max_groups, lanes = limits
        return (
            0 < self.groups <= max_groups
            and self.dim <= max_dim
            and self.dim % self.groups == 0
            and self.dim // self.groups % lanes == 0
        )

    def _laid_out(self) -> bool:
        codes, scales, biases = self.codes, self.scales, self.biases
        if scales is None:
            return self.bits == 16 and codes.dtype == np.float16 and codes.strides[-1] == 2
        return (
            self.bits in (4, 8)
            and codes.dtype == np.uint32
            and codes.strides[-1] == 4
            and scales.dtype == biases.dtype == np.float16
            and scales.shape == biases.shape == (*codes.shape[:2], self.groups)
            and scales.strides == biases.strides
            and scales.strides[-1] == 2
        )

    def fields(self) -> list[int]:
        """The store as `reprise_kv_attend` reads it, every head (its `STORE_FIELDS`)."""
        scales = [0, 0, 0, 0] if self.scales is None else [
            self.scales.ctypes.data, self.biases.ctypes.data,
            self.scales.strides[1] // 2, self.scales.strides[0] // 2,
        ]  # fmt: skip
        return [
            self.codes.ctypes.data, self.codes.strides[1], self.codes.strides[0], *scales,
            self.tokens, self.dim, self.bits, self.groups,
        ]  # fmt: skip


def attend(
    stores: list[Rows], q: np.ndarray, bulk_q: np.ndarray, out: np.ndarray, threads: int = 1
) -> None:
    """A decode step's attention of one layer (kvcpu.decode's maths, in one call), its
    tokens shared among up to `threads` threads: `stores` exact keys, exact values,
    bulk keys, bulk values; q and bulk_q (KV heads, queries, key dim) contiguous
    float32, the bulk's query rotated where its keys are; out (KV heads, queries,
    value dim) contiguous float32."""
    exact_k, exact_v, bulk_k, bulk_v = stores
    heads, queries, key_dim = q.shape
    _require(all(rows.fits(queries) and len(rows.codes) == heads for rows in stores))
    _require(exact_k.tokens == exact_v.tokens and bulk_k.tokens == bulk_v.tokens)
    _require(exact_k.dim == bulk_k.dim == key_dim and exact_v.dim == bulk_v.dim)
    for array in (q, bulk_q, out):
        _require(array.dtype == np.float32 and array.flags.c_contiguous)
    _require(bulk_q.shape == q.shape and out.shape == (heads, queries, bulk_v.dim))
    fields = np.array([field for rows in stores for field in rows.fields()], np.int64)
    done = _load().reprise_kv_attend(
        fields.ctypes.data, heads, q.ctypes.data, bulk_q.ctypes.data, queries,
        max(1, threads), out.ctypes.data,
    )  # fmt: skip
    if not done:
        raise MemoryError("no memory for a layer's attention sums")


def widen_halves(rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """float16 `rows` (batch, heads, tokens, width), each head's tokens contiguous (a
    cache buffer sliced on its token axis), as float32, into `out` (contiguous, of
    their shape) or a new array."""
    batch, heads, tokens, width = rows.shape
    _require(rows.dtype == np.float16 and rows.strides[3] == 2 and rows.strides[2] == 2 * width)
    _require(batch == 1 or rows.strides[0] == heads * rows.strides[1])
    out = np.empty(rows.shape, np.float32) if out is None else out
    _require(out.shape == rows.shape and out.dtype == np.float32 and out.flags.c_contiguous)
    _load().reprise_kv_widen_halves(
        rows.ctypes.data, rows.strides[1] // 2, batch * heads, tokens * width, out.ctypes.data
    )
    return out


# short_turn.c's tiles: queries in vectors of 16, two at a time for the scores, four
# at a time for the values; dimensions four vectors at a time.
TURN_QUERIES, TURN_VALUE_QUERIES, TURN_DIMS = 32, 4, 64


def turn_fits(dim: int) -> bool:
    """Whether short_turn.c takes rows `dim` wide (and is to be used: `available`)."""
    return available() and 0 < dim <= _load().turn_limits[0] and dim % TURN_DIMS == 0


def turn_faster_here() -> bool:
    """Whether a short turn's attention should go to short_turn.c: its AVX-512 build
    runs on this CPU (its AVX2 build spills its tiles, slower than mlx's route)."""
    return available() and _load().turn_fast


def turn_max_queries() -> int:
    """The most queries a KV head short_turn.c's softmax holds sums for."""
    return _load().turn_limits[1]


def turn_scores(rows: np.ndarray | PackedTurnRows, qt: np.ndarray, st: np.ndarray) -> None:
    """st = rows @ qt: float16 rows (tokens, dim), each row contiguous, or packed rows
    (`PackedTurnRows`), widened as they are read; qt (dim, queries) contiguous float32,
    queries a multiple of TURN_QUERIES; st (tokens, queries) contiguous float32."""
    tokens, dim = _turn_rows(rows)
    queries = qt.shape[1]
    _require(qt.dtype == st.dtype == np.float32 and qt.flags.c_contiguous and st.flags.c_contiguous)
    _require(qt.shape[0] == dim and queries % TURN_QUERIES == 0 and st.shape == (tokens, queries))
    if isinstance(rows, PackedTurnRows):
        _load().reprise_turn_scores_packed(*rows.fields(), qt.ctypes.data, queries, st.ctypes.data)
        return
    _load().reprise_turn_scores(
        rows.ctypes.data, rows.strides[0] // 2, tokens, dim, qt.ctypes.data, queries, st.ctypes.data
    )


def turn_softmax(st: np.ndarray) -> np.ndarray:
    """Token-major scores st (tokens, queries) contiguous float32, queries a multiple
    of TURN_QUERIES up to `turn_max_queries()` -> e^(score - its query's maximum), in
    place; each query's sum (queries,)."""
    _require(st.dtype == np.float32 and st.ndim == 2 and st.flags.c_contiguous)
    _require(st.shape[1] % TURN_QUERIES == 0 and st.shape[1] <= _load().turn_limits[1])
    totals = np.empty(st.shape[1], np.float32)
    _load().reprise_turn_softmax(st.ctypes.data, st.shape[0], st.shape[1], totals.ctypes.data)
    return totals


def turn_values(rows: np.ndarray | PackedTurnRows, pt: np.ndarray, out: np.ndarray) -> None:
    """out += pt[:, :used].T @ rows: rows as for `turn_scores`; pt (tokens, queries)
    contiguous float32; out (used, dim) contiguous float32, used a multiple of
    TURN_VALUE_QUERIES, at most queries."""
    tokens, dim = _turn_rows(rows)
    used, queries = len(out), pt.shape[1]
    _require(
        pt.dtype == out.dtype == np.float32 and pt.flags.c_contiguous and out.flags.c_contiguous
    )
    _require(pt.shape[0] == tokens and out.shape[1] == dim)
    _require(used % TURN_VALUE_QUERIES == 0 and used <= queries)
    if isinstance(rows, PackedTurnRows):
        _load().reprise_turn_values_packed(
            *rows.fields(), pt.ctypes.data, queries, used, out.ctypes.data
        )
        return
    _load().reprise_turn_values(
        rows.ctypes.data, rows.strides[0] // 2, tokens, dim, pt.ctypes.data, queries, used,
        out.ctypes.data,
    )  # fmt: skip


def _turn_rows(rows: np.ndarray | PackedTurnRows) -> tuple[int, int]:
    """(tokens, dim) of rows the turn products read: packed ones were checked when
    made; float16 ones each contiguous, whole halves apart, of a width they take."""
    if isinstance(rows, PackedTurnRows):
        return rows.tokens, rows.dim
    tokens, dim = rows.shape
    _require(turn_fits(dim) and rows.dtype == np.float16 and rows.strides[1] == 2)
    _require(rows.strides[0] % 2 == 0)
    return tokens, dim


class PackedTurnRows:
    """One KV head's tokens packed 4 or 8 bits a value, as short_turn.c reads them:
    `codes` (tokens, words) uint32, `scales` and `biases` (tokens, groups) float16,
    each token's contiguous (views of a store's buffers, sliced on the tokens)."""

    def __init__(self, bits: int, codes: np.ndarray, scales: np.ndarray, biases: np.ndarray):
        self.bits, self.codes, self.scales, self.biases = bits, codes, scales, biases
        self.tokens, self.groups = scales.shape
        self.dim = codes.shape[1] * 32 // bits
        _require(self.takes(bits, codes, scales, biases))

    @staticmethod
    def takes(bits: int, codes: np.ndarray, scales: np.ndarray, biases: np.ndarray) -> bool:
        """Whether the C reads these as packed rows: a width it unpacks, whole groups
        of a width the products take, every token's codes and scales contiguous."""
        if codes.ndim != 2 or scales.ndim != 2 or bits not in (4, 8):
            return False
        dim, groups = codes.shape[1] * 32 // bits, scales.shape[1]
        return (
            groups > 0
            and turn_fits(dim)
            and codes.dtype == np.uint32
            and scales.dtype == biases.dtype == np.float16
            and scales.shape == biases.shape == (codes.shape[0], groups)
            and scales.strides == biases.strides
            and codes.strides[1] == 4
            and scales.strides[1] == 2
            # whole elements from a token to the next (the C steps in words and halves)
            and codes.strides[0] % 4 == 0
            and scales.strides[0] % 2 == 0
            and dim % groups == 0
            and dim // groups % 2 == 0
        )

    def fields(self) -> list[int]:
        """The first nine arguments of the packed turn products."""
        return [
            self.codes.ctypes.data, self.codes.strides[0] // 4, self.scales.ctypes.data,
            self.biases.ctypes.data, self.scales.strides[0] // 2, self.bits, self.groups,
            self.tokens, self.dim,
        ]  # fmt: skip


def _require(condition: bool) -> None:
    """The C reads what the arrays' shapes say, within its limits: a mismatch is a bug,
    never read past."""
    if not condition:
        raise ValueError("arrays do not fit the packed-cache products")
