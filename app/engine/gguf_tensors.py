"""A GGUF file's tensors read from its bytes, stored as MLX arrays at the precision asked for.

Each tensor is read at the offset `gguf_check` verified, so nothing here trusts
the file. What it becomes depends on `bits`, the import's choice:

- `None` (the default, "as the file"): Q4_0, Q4_1, Q4_K stay 4-bit, Q5_K 5-bit
  and Q8_0 8-bit, all exactly (their groups of 32 are MLX's affine groups; only
  the scales round to float16). Q6_K becomes 8-bit and Q2_K, Q3_K 4-bit, quantized
  again from their values (mlx has no group of 16, theirs). Float tensors stay
  float: F32 as it is, F16 and BF16 as float16.
- 4 or 8: every matrix at that many bits; those already there stay exact, the
  rest are quantized again (group 32 from a quantized type, aligned to its
  blocks; group 64, mlx-lm's default, from a float one).
- 16: every tensor as float16 (the largest, no quantization error of our own).

A mixture of experts' stacked expert matrices (experts x rows x columns) are
matrices here too, quantized per expert row like any other; the router choosing
among them is never below 8 bits. Tensors that are not
matrices (norms, biases) are always float.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import mlx.core as mx
import numpy as np

from app.engine.gguf_check import GGUFImportError, GGUFLayout, TensorRecord
from app.engine.gguf_kquants import QUANTIZED_TYPES, Groups, decode, pack

BITS_CHOICES = (None, 4, 8, 16)
# What `bits=None` keeps each quantized type at.
AS_THE_FILE = {
    "Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_K": 5, "Q8_0": 8, "Q6_K": 8, "Q2_K": 4, "Q3_K": 4,
}  # fmt: skip
_FLOAT_GROUP, _QUANTIZED_GROUP = 64, 32
_INTEGERS = {"I8": np.int8, "I16": np.int16, "I32": np.int32}


def read_tensors(
    path: Path, layout: GGUFLayout, bits: int | None = None
) -> tuple[dict[str, mx.array], str]:
    """Every tensor as mlx arrays (`name`, or `name.weight/.scales/.biases` stems), and a
    line saying how they are stored, e.g. "Q4_K as 4-bit (exact), Q6_K as 8-bit"."""
    if bits not in BITS_CHOICES:
        raise GGUFImportError(f"Cannot store weights at {bits} bits (4, 8 or 16, or as the file)")
    tensors: dict[str, mx.array] = {}
    stored: dict[str, set[str]] = defaultdict(set)
    with np.errstate(all="ignore"):  # a damaged scale is a NaN weight, not a warning
        for record in layout.tensors:
            raw = np.fromfile(
                path, dtype=np.uint8, count=record.size, offset=layout.data_start + record.offset
            )
            arrays, how = _convert(record, raw, bits)
            stem = record.name.removesuffix(".weight")
            if len(arrays) == 1:
                tensors[record.name] = arrays[0]
            else:
                for suffix, array in zip(("weight", "scales", "biases"), arrays, strict=True):
                    tensors[f"{stem}.{suffix}"] = array
            stored[record.type_name].add(how)
    summary = ", ".join(f"{t} as {' and '.join(sorted(h))}" for t, h in sorted(stored.items()))
    return tensors, summary


def _convert(record: TensorRecord, raw: np.ndarray, bits: int | None) -> tuple[list, str]:
    if bits == 4 and record.name.endswith(".ffn_gate_inp.weight"):
        # A mixture's router picks the experts: a small matrix that mlx-lm's own
        # qwen3_moe quantization keeps at 8 bits, as llama.cpp keeps it float.
        bits = 8
    shape = tuple(reversed(record.dims))  # GGUF lists the row length first
    # a matrix, or a stack of them (a mixture of experts' `ffn_*_exps`, experts first)
    matrix = len(shape) in (2, 3) and record.name.endswith(".weight")
    if record.type_name not in QUANTIZED_TYPES:
        values = _floats(record.type_name, raw).reshape(shape)
        if matrix and bits in (4, 8) and shape[-1] % _FLOAT_GROUP == 0:
            return _quantize(values, bits, _FLOAT_GROUP), f"{bits}-bit"
        if bits == 16 and values.dtype == np.float32 and matrix:
            values = values.astype(np.float16)
        return [mx.array(values)], values.dtype.name
    groups = decode(record.type_name, raw)
    target = bits or AS_THE_FILE[record.type_name]
    if not matrix or target == 16:
        return [mx.array(groups.values().reshape(shape).astype(np.float16))], "float16"
    if groups.q.shape[1] == _QUANTIZED_GROUP and groups.bits == target:
        return _exact(groups, shape), f"{target}-bit (exact)"
    return _quantize(groups.values().reshape(shape), target, _QUANTIZED_GROUP), f"{target}-bit"


def _floats(type_name: str, raw: np.ndarray) -> np.ndarray:
    if type_name == "F32":
        return raw.view(np.float32)
    if type_name == "F16":
        return raw.view(np.float16)
    if type_name == "BF16":  # bfloat16 is float32's top half
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float16)
    return raw.view(_INTEGERS[type_name])


def _exact(groups: Groups, shape: tuple[int, ...]) -> list[mx.array]:
    *outer, columns = shape
    per_row = columns // _QUANTIZED_GROUP
    packed = pack(groups.q.reshape(-1, columns), groups.bits)
    return [
        mx.array(packed.reshape(*outer, -1)),
        mx.array(groups.scale.reshape(*outer, per_row).astype(np.float16)),
        mx.array(groups.bias.reshape(*outer, per_row).astype(np.float16)),
    ]


def _quantize(values: np.ndarray, bits: int, group: int) -> list[mx.array]:
    # From float32: rounding the values to float16 first would move some across a step.
    weight, scales, biases = mx.quantize(
        mx.array(values.astype(np.float32)), group_size=group, bits=bits
    )
    arrays = [weight, scales.astype(mx.float16), biases.astype(mx.float16)]
    mx.eval(*arrays)
    return arrays
