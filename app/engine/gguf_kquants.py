"""ggml's quantized blocks, decoded from a tensor's bytes into affine groups.

Every quantized type we import stores, per group of 16 or 32 values, small
unsigned integers `q` and a value for each: `scale * q + bias`. Written that way,
a type whose groups are 32 long (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K) is exactly MLX's
affine quantization with group size 32 and the same bits, so it is stored as it
is (`pack` lays the integers out as mlx does); the others (Q2_K, Q3_K, Q6_K: 16
values a group, which mlx does not offer) are dequantized and quantized again.
mlx 0.32.4's own GGUF reader gets Q4_K wrong and cannot read Q3_K or Q5_K at all,
which is why the bytes are decoded here.

Block layouts (ggml's ggml-common.h; 256 values a K-quant super-block):
- Q4_0: d, 16 bytes of nibbles (low nibbles values 0-15, high 16-31); d * (q - 8).
- Q4_1: d, m, nibbles as Q4_0; d * q + m.
- Q8_0: d, 32 signed bytes; d * q.
- Q2_K: 16 bytes of 4-bit scale | 4-bit min << 4, 64 bytes of 2-bit values, d, dmin.
- Q3_K: 32 bytes of high bits, 64 bytes of 2-bit values, 12 bytes packing sixteen
  6-bit signed (offset 32) scales, d; d * scale * (q - 4).
- Q4_K, Q5_K: d, dmin, 12 bytes packing eight 6-bit scales and mins, (Q5_K: 32
  bytes of fifth bits,) 128 bytes of nibbles; d * scale * q - dmin * min.
- Q6_K: 128 bytes of low nibbles, 64 bytes of 2-bit high parts, sixteen signed
  8-bit scales, d; d * scale * (q - 32).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QUANTIZED_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


@dataclass(frozen=True)
class Groups:
    """A tensor's values as `scale * q + bias`, one scale and bias per row of `q`."""

    q: np.ndarray  # uint8, (groups, 16 or 32)
    scale: np.ndarray  # float32, (groups,)
    bias: np.ndarray  # float32, (groups,)
    bits: int

    def values(self) -> np.ndarray:
        return (self.q * self.scale[:, None] + self.bias[:, None]).reshape(-1)


def _f16(column: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(column).view(np.float16).astype(np.float32).reshape(-1)


def _bits_at(data: np.ndarray, shifts: list[int], mask: int) -> np.ndarray:
    """(blocks, n) bytes -> (blocks, len(shifts), n): each shift's `mask` bits."""
    return (data[:, None, :] >> np.array(shifts, dtype=np.uint8)[None, :, None]) & mask


def _q4_0(blocks: np.ndarray) -> Groups:
    d = _f16(blocks[:, 0:2])
    q = _bits_at(blocks[:, 2:18], [0, 4], 0x0F).reshape(-1, 32)
    return Groups(q, d, -8 * d, 4)


def _q4_1(blocks: np.ndarray) -> Groups:
    q = _bits_at(blocks[:, 4:20], [0, 4], 0x0F).reshape(-1, 32)
    return Groups(q, _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4]), 4)


def _q8_0(blocks: np.ndarray) -> Groups:
    d = _f16(blocks[:, 0:2])
    q = (blocks[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return Groups(q, d, -128 * d, 8)


def _k_scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: the eight 6-bit scales and mins of each block, from twelve bytes."""
    low, mid, high = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([low & 63, (high & 0x0F) | ((low >> 6) << 4)], axis=1)
    mins = np.concatenate([mid & 63, (high >> 4) | ((mid >> 6) << 4)], axis=1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _q4_k_or_q5_k(blocks: np.ndarray, fifth_bits: bool) -> Groups:
    d = _f16(blocks[:, 0:2])[:, None]
    dmin = _f16(blocks[:, 2:4])[:, None]
    scales, mins = _k_scales_and_mins(blocks[:, 4:16])
    start = 48 if fifth_bits else 16
    # Each 32-byte chunk c holds sub-block 2c in its low nibbles, 2c + 1 in its high ones.
    chunks = blocks[:, start : start + 128].reshape(-1, 4, 32)
    q = np.stack([chunks & 0x0F, chunks >> 4], axis=2).reshape(-1, 8, 32)
    if fifth_bits:  # bit s of high byte l is the fifth bit of sub-block s's value l
        q = q | (_bits_at(blocks[:, 16:48], list(range(8)), 1) << 4)
    bits = 5 if fifth_bits else 4
    return Groups(q.reshape(-1, 32), (d * scales).reshape(-1), (-dmin * mins).reshape(-1), bits)


def _two_bit_planes(data: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K: 64 bytes of 2-bit values -> 256; value 128h + 32s + l sits at
    bits 2s of byte 32h + l."""
    halves = data.reshape(-1, 2, 32)
    planes = (halves[:, :, None, :] >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3
    return planes.reshape(-1, 256)


def _q2_k(blocks: np.ndarray) -> Groups:
    d = _f16(blocks[:, 80:82])[:, None]
    dmin = _f16(blocks[:, 82:84])[:, None]
    packed = blocks[:, 0:16]
    scale = d * (packed & 0x0F).astype(np.float32)
    bias = -dmin * (packed >> 4).astype(np.float32)
    q = _two_bit_planes(blocks[:, 16:80]).reshape(-1, 16)
    return Groups(q, scale.reshape(-1), bias.reshape(-1), 2)


def _q3_k(blocks: np.ndarray) -> Groups:
    d = _f16(blocks[:, 108:110])[:, None]
    packed = blocks[:, 96:108]
    # Sixteen 6-bit scales: low four bits from bytes 0-7 (low nibbles, then high),
    # top two bits from bytes 8-11 (scale i at bits 2 * (i // 4) of byte 8 + i % 4).
    low = _bits_at(packed[:, 0:8], [0, 4], 0x0F).reshape(-1, 16)
    high = _bits_at(packed[:, 8:12], [0, 2, 4, 6], 3).reshape(-1, 16)
    scale = d * ((low | (high << 4)).astype(np.float32) - 32)
    # A set high bit means the value has no -4 offset: q = low two bits + 4 * high bit.
    high_bits = _bits_at(blocks[:, 0:32], list(range(8)), 1).reshape(-1, 256)
    q = (_two_bit_planes(blocks[:, 32:96]) | (high_bits << 2)).reshape(-1, 16)
    return Groups(q, scale.reshape(-1), -4 * scale.reshape(-1), 3)


def _q6_k(blocks: np.ndarray) -> Groups:
    # Value 128h + 64n + j: nibble n of byte 64h + j; value 128h + 32s + l: its top
    # two bits at bits 2s of high byte 32h + l.
    low = _bits_at(blocks[:, 0:128].reshape(-1, 64), [0, 4], 0x0F).reshape(-1, 256)
    high = _two_bit_planes(blocks[:, 128:192])
    scale = _f16(blocks[:, 208:210])[:, None] * blocks[:, 192:208].view(np.int8)
    scale = scale.astype(np.float32).reshape(-1)
    return Groups((low | (high << 4)).reshape(-1, 16), scale, -32 * scale, 6)


_DECODERS = {
    "Q4_0": (18, _q4_0),
    "Q4_1": (20, _q4_1),
    "Q8_0": (34, _q8_0),
    "Q2_K": (84, _q2_k),
    "Q3_K": (110, _q3_k),
    "Q4_K": (144, lambda blocks: _q4_k_or_q5_k(blocks, False)),
    "Q5_K": (176, lambda blocks: _q4_k_or_q5_k(blocks, True)),
    "Q6_K": (210, _q6_k),
}


def decode(type_name: str, raw: np.ndarray) -> Groups:
    """A tensor's bytes (whole blocks of `type_name`) as affine groups, in value order."""
    size, decoder = _DECODERS[type_name]
    return decoder(raw.reshape(-1, size))


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """(rows, n) integers below 2**bits -> mlx's packed uint32 (rows, n * bits / 32).

    mlx lays the values of a row end to end as one little-endian bit stream, value i
    at bits [bits * i, bits * (i + 1)): eight values make `bits` whole bytes.
    """
    rows = q.shape[0]
    eight = q.reshape(-1, 8).astype(np.uint64)
    word = np.zeros(eight.shape[0], dtype=np.uint64)
    for i in range(8):
        word |= eight[:, i] << np.uint64(bits * i)
    packed = word.view(np.uint8).reshape(-1, 8)[:, :bits]
    return np.ascontiguousarray(packed).reshape(rows, -1).view(np.uint32)
