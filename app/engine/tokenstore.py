"""One half (keys or values) of a KV layer's tokens, 16-bit or quantized, in a
buffer that grows in steps (app/engine/kvquant.py puts two of each in a layer)."""

from __future__ import annotations

import math
from functools import cache

import mlx.core as mx

_SIXTEEN = (mx.float16, mx.bfloat16)
STEP = 256  # tokens a store grows by


def sixteen_bit(x: mx.array) -> mx.array:
    """Full-precision parts are kept in 16 bits: the model's own 16-bit type, or
    float16 where it computes in float32 (the CPU path)."""
    return x if x.dtype in _SIXTEEN else x.astype(mx.float16)


def as_dtype(x: mx.array, dtype: mx.Dtype) -> mx.array:
    return x if x.dtype == dtype else x.astype(dtype)


def rotate(x: mx.array) -> mx.array:
    """The normalized Walsh-Hadamard transform along the head axis; float16 is rotated
    in float32 (float16 arithmetic is emulated on the CPU)."""
    wide = x.astype(mx.float32) if x.dtype == mx.float16 else x
    return mx.hadamard_transform(wide, scale=1 / math.sqrt(x.shape[-1]))


def unrotate(x: mx.array) -> mx.array:
    """`rotate` undone. For a power-of-two head size the transform is its own inverse;
    mlx builds the others (20 or 28 times a power of two: 80, 160, 224...) from a
    matrix that is orthogonal but not symmetric, so there the inverse is its transpose."""
    dim = x.shape[-1]
    if dim & (dim - 1) == 0:
        return rotate(x)
    wide = x.astype(mx.float32) if x.dtype == mx.float16 else x
    return wide @ rotation_matrix(dim).T


def joined(chunks: list[mx.array], capacity: int) -> mx.array:
    """Chunks of a run of layers' tokens (layers first, tokens on axis 3) in one array,
    with zero rows after them up to `capacity` tokens: one copy, however many layers
    and chunks."""
    pad = _room(chunks, capacity, chunks[0].dtype, chunks[0].shape[:3])
    return mx.concatenate([*chunks, pad], axis=3)


def _room(chunks: list[mx.array], capacity: int, dtype: mx.Dtype, lead: tuple) -> mx.array:
    """Zero rows from the chunks' last token up to `capacity`, shaped `lead` + (rows,
    width) (the chunks: layers first, tokens on axis 3)."""
    room = capacity - sum(chunk.shape[3] for chunk in chunks)
    return mx.zeros((*lead, room, chunks[0].shape[4]), dtype)


def layer_rows(stacked: mx.array) -> list[mx.array]:
    """A run's buffer (layers first, then a batch of one) as an array per layer, each
    a view of its row: one split for them all (an index per layer is a graph node
    each, and on the CPU every node costs)."""
    layers = stacked.shape[0]
    return mx.split(stacked.reshape(layers * stacked.shape[1], *stacked.shape[2:]), layers)


@cache
def rotation_matrix(dim: int) -> mx.array:
    """`rotate` as a matrix on row vectors: rotate(x) == x @ _rotation(dim)."""
    return rotate(mx.eye(dim, dtype=mx.float32))


class TokenStore:
    """One half (keys or values) of a layer's tokens along axis 2, 16-bit or
    quantized, in a buffer that grows in steps and can drop tokens from its front."""

    def __init__(
        self, bits: int | None, group_size: int, rotate: bool = False, step: int = STEP
    ) -> None:
        self.bits, self.group_size, self.rotate, self.step = bits, group_size, rotate, step
        self.buffers: list[mx.array] = []
        self.lo = self.hi = 0

    def __len__(self) -> int:
        return self.hi - self.lo

    def encode(self, x: mx.array) -> list[mx.array]:
        """16-bit rows as this store holds them."""
        if self.rotate:
            x = rotate(x)
        x = sixteen_bit(x)
        if self.bits is None:
            return [x]
        return list(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def decode(self, parts: list[mx.array], dtype: mx.Dtype) -> mx.array:
        if self.bits is None:
            x = parts[0]
        else:
            weights, scales, biases = parts
            if dtype == mx.float32:
                # CPU float16 arithmetic is emulated: dequantizing with float16 scales
                # took 6x as long as with the (small) scales upcast first.
                scales, biases = scales.astype(dtype), biases.astype(dtype)
            x = mx.dequantize(weights, scales, biases, group_size=self.group_size, bits=self.bits)
        x = as_dtype(x, dtype)
        return as_dtype(unrotate(x), dtype) if self.rotate else x

    def append_encoded(self, parts: list[mx.array]) -> None:
        n = parts[0].shape[2]
        if not self.buffers or self.hi + n > self.buffers[0].shape[2]:
            self._regrow(n, parts)
        for buffer, part in zip(self.buffers, parts, strict=True):
            buffer[..., self.hi : self.hi + n, :] = part
        self.hi += n

    def hold(self, buffers: list[mx.array], rows: int) -> None:
        """Take `buffers` as they are, their first `rows` tokens held and the rest room
        for the tokens to come (a restore builds them)."""
        self.buffers, self.lo, self.hi = list(buffers), 0, rows

    def _regrow(self, n: int, parts: list[mx.array]) -> None:
        """Move the live tokens to the front of a buffer with room for `n` more."""
        size = len(self)
        capacity = (size + n + self.step - 1) // self.step * self.step
        grown = []
        for i, part in enumerate(parts):
            shape = (*part.shape[:2], capacity, part.shape[3])
            fresh = mx.zeros(shape, part.dtype)
            if size:
                fresh[..., :size, :] = self.buffers[i][..., self.lo : self.hi, :]
            grown.append(fresh)
        self.buffers, self.lo, self.hi = grown, 0, size

    def span(self, start: int = 0, end: int | None = None) -> slice:
        """Where tokens [start, end) lie along the buffers' token axis (2)."""
        end = len(self) if end is None else end
        return slice(self.lo + start, self.lo + end)

    def encoded(self, start: int = 0, end: int | None = None) -> list[mx.array]:
        span = self.span(start, end)
        return [b[..., span, :] for b in self.buffers]

    def read(self, dtype: mx.Dtype, start: int = 0, end: int | None = None) -> mx.array:
        return self.decode(self.encoded(start, end), dtype)

    def drop(self, n: int, after: int = 0) -> None:
        """Drop `n` tokens, keeping the first `after` (sink rows, a window's kept tokens)."""
        n = min(n, len(self) - after)
        if n <= 0:
            return
        if after:  # move the kept tokens up by a copy
            for buffer in self.buffers:
                buffer[..., self.lo + n : self.lo + n + after, :] = mx.array(
                    buffer[..., self.lo : self.lo + after, :]
                )
        self.lo += n

    def trim(self, n: int) -> None:
        self.hi -= min(n, len(self))

    def untrim(self, n: int) -> None:
        """Take back `n` tokens a `trim` left in the buffers, unwritten since."""
        self.hi += n

    def compact(self) -> None:
        """Give back a buffer far larger than its tokens (the 16-bit store after a
        long prefill is flushed), so that it does not stay allocated."""
        size = len(self)
        if not self.buffers or self.buffers[0].shape[2] <= 2 * (size + self.step):
            return
        capacity = (size // self.step + 1) * self.step
        smaller = []
        for buffer in self.buffers:
            fresh = mx.zeros((*buffer.shape[:2], capacity, buffer.shape[3]), buffer.dtype)
            if size:
                fresh[..., :size, :] = buffer[..., self.lo : self.hi, :]
            smaller.append(fresh)
        self.buffers, self.lo, self.hi = smaller, 0, size

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    @property
    def dtype(self) -> mx.Dtype:
        """The 16-bit type it dequantizes from (its scales' type when quantized)."""
        return self.buffers[0 if self.bits is None else 1].dtype
