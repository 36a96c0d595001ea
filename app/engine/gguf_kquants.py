"""Q4_K tensors, dequantized here because mlx's own reading of them is wrong.

mlx 0.32.4's `mx.load` turns Q2_K, Q4_K and Q6_K tensors into float16, but its
Q4_K conversion gets the second half of each 64-value chunk wrong (errors as
large as the weights, measured against the `gguf` package's reference
dequantization); Q2_K and Q6_K agree with the reference. So every Q4_K tensor
mx.load returned is replaced by ours, read from the file's own bytes at the
offset `gguf_check` verified.

A Q4_K block holds 256 values in 144 bytes: a float16 scale `d` and min scale
`dmin`, twelve bytes packing eight 6-bit sub-scales and eight 6-bit sub-mins,
and 128 bytes of 4-bit values. Each 64-value chunk takes 32 bytes: low nibbles
are its first sub-block, high nibbles its second; value = d * scale * q - dmin * min.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from app.engine.gguf_check import GGUFLayout

_Q4_K_BLOCK = 144


def _scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and mins of each block, from its twelve packed bytes."""
    low, mid, high = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([low & 63, (high & 0x0F) | ((low >> 6) << 4)], axis=1)
    mins = np.concatenate([mid & 63, (high >> 4) | ((mid >> 6) << 4)], axis=1)
    return scales.astype(np.float32), mins.astype(np.float32)


def dequantize_q4_k(raw: np.ndarray) -> np.ndarray:
    """Q4_K blocks (bytes) -> float32 values, 256 per block."""
    blocks = raw.reshape(-1, _Q4_K_BLOCK)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    scales, mins = _scales_and_mins(blocks[:, 4:16])
    quants = blocks[:, 16:].reshape(-1, 4, 1, 32)
    # Sub-block 2c is chunk c's low nibbles, sub-block 2c + 1 its high ones.
    nibbles = np.concatenate([quants & 0x0F, quants >> 4], axis=2).reshape(-1, 8, 32)
    values = (d * scales)[:, :, None] * nibbles - (dmin * mins)[:, :, None]
    return values.reshape(-1)


def replace_q4_k(path: Path, layout: GGUFLayout, tensors: dict[str, mx.array]) -> None:
    """Every Q4_K tensor in `tensors` replaced by float16 values read from `path`."""
    for record in layout.tensors:
        if record.type_name != "Q4_K" or record.name not in tensors:
            continue
        raw = np.fromfile(
            path, dtype=np.uint8, count=record.size, offset=layout.data_start + record.offset
        )
        shape = tensors[record.name].shape
        tensors[record.name] = mx.array(dequantize_q4_k(raw).reshape(shape).astype(np.float16))
