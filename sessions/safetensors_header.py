"""The safetensors layout of cache files, read and checked by our own code.

A safetensors file is an 8-byte little-endian header length, a JSON header
(tensor name -> dtype, shape, data offsets; "__metadata__" -> strings) and
the tensors' bytes. A cache file is untrusted: before any loader sees it, the
header is parsed here and every declared size is checked against the file's
size and against the other tensors (no overlap, no gap, nothing past the end),
so a header that claims gigabytes is refused before a byte of data is read.

The checksum covers the header's meaning (every tensor's name, dtype, shape and
offsets, and every metadata entry but the checksum itself) and then the data:
relabelling a tensor's dtype is caught as surely as a flipped bit. xxHash's
XXH3 (64-bit) runs at memory speed, well above the disk.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
import xxhash

from sessions.errors import CacheRejected

CHECKSUM_KEY = "checksum"
CHECKSUM_PREFIX = "xxh3-64:"
MAX_HEADER_BYTES = 16 * 1024 * 1024  # a cache file's header is a few KiB
MAX_TENSORS = 65536
MAX_DIMS = 8
MAX_DIM = 2**31 - 1  # mlx keeps dimensions in 32-bit integers
MAX_NAME = 256
# The dtypes a cache file may hold (bfloat16 is stored as its raw 16 bits, uint16).
DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "I32": np.dtype("<i4"),
}
_CODES = {dtype.name: code for code, dtype in DTYPES.items()}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # a key of DTYPES
    shape: tuple[int, ...]
    begin: int  # offsets into the data section
    end: int


@dataclass(frozen=True)
class Header:
    tensors: tuple[TensorSpec, ...]  # in the order of their data
    metadata: dict[str, str]
    data_start: int  # where the data section starts in the file
    data_bytes: int


def dtype_code(dtype: object) -> str | None:
    """The safetensors code of a numpy or mlx dtype ("F16" for float16); None if not allowed."""
    return _CODES.get(str(dtype).rsplit(".", 1)[-1])


def parse_header(f: BinaryIO, file_size: int) -> Header:
    """Read and check the header of the open file `f` of `file_size` bytes."""
    if file_size < 8:
        raise CacheRejected("unreadable file (shorter than a header)")
    (length,) = struct.unpack("<Q", _read_exactly(f, 8))
    if length < 2 or length > MAX_HEADER_BYTES:
        raise CacheRejected(f"unreadable file (a header of {length} bytes)")
    if 8 + length > file_size:
        raise CacheRejected("unreadable file (the header runs past the end)")
    raw = _read_exactly(f, length)
    try:
        parsed = json.loads(
            raw.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_no_constant
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CacheRejected(f"unreadable file (header is not JSON: {exc})") from None
    if not isinstance(parsed, dict):
        raise CacheRejected("unreadable file (header is not a JSON object)")
    metadata = parsed.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise CacheRejected("unreadable file (metadata is not text)")
    if len(parsed) > MAX_TENSORS:
        raise CacheRejected(f"unreadable file ({len(parsed)} tensors)")
    tensors = sorted((_tensor(name, entry) for name, entry in parsed.items()), key=_data_order)
    data_bytes = file_size - 8 - length
    position = 0
    for tensor in tensors:
        if tensor.begin != position:
            what = "overlaps another" if tensor.begin < position else "leaves a gap"
            raise CacheRejected(f"unreadable file (tensor {tensor.name!r} {what})")
        position = tensor.end
    if position != data_bytes:
        raise CacheRejected(
            f"unreadable file (tensors declare {position} bytes, the file holds {data_bytes})"
        )
    return Header(tuple(tensors), metadata, 8 + length, data_bytes)


def _data_order(tensor: TensorSpec) -> tuple[int, int, str]:
    return tensor.begin, tensor.end, tensor.name


def _read_exactly(f: BinaryIO, size: int) -> bytes:
    data = f.read(size)
    if len(data) != size:
        raise CacheRejected("unreadable file (shorter than its header says)")
    return data


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    result = dict(pairs)
    if len(result) != len(pairs):  # other parsers may keep the first where Python keeps the last
        raise ValueError("a name appears twice")
    return result


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number here")


def _tensor(name: str, entry: object) -> TensorSpec:
    if not name or len(name) > MAX_NAME:
        raise CacheRejected("unreadable file (a tensor name is empty or too long)")
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise CacheRejected(f"unreadable file (tensor {name!r} is not described)")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPES:
        raise CacheRejected(f"unreadable file (tensor {name!r} has dtype {str(dtype)[:16]!r})")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_DIMS
        or not all(_is_int(d) and 0 <= d <= MAX_DIM for d in shape)
    ):
        raise CacheRejected(f"unreadable file (tensor {name!r} has a bad shape)")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise CacheRejected(f"unreadable file (tensor {name!r} has bad offsets)")
    if offsets[1] - offsets[0] != math.prod(shape) * DTYPES[dtype].itemsize:
        raise CacheRejected(f"unreadable file (tensor {name!r} size does not match its shape)")
    return TensorSpec(name, dtype, tuple(shape), offsets[0], offsets[1])


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_expected(
    header: Header,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
    size: int | None = None,
    file_size: int | None = None,
) -> None:
    """Refuse a file whose tensors are not exactly `shapes`, or whose size is not `size`."""
    if size is not None and file_size is not None and size != file_size:
        raise CacheRejected(f"file size {file_size} is not the {size} bytes written")
    if shapes is None:
        return
    declared = {t.name: t.shape for t in header.tensors}
    if set(declared) != set(shapes):
        missing, extra = sorted(set(shapes) - set(declared)), sorted(set(declared) - set(shapes))
        raise CacheRejected(f"wrong tensors (missing {missing[:3]}, unexpected {extra[:3]})")
    for name, shape in shapes.items():
        if declared[name] != tuple(shape):
            raise CacheRejected(f"{name} has the wrong shape {declared[name]}")


def _canonical(tensors: Iterable[TensorSpec], metadata: Mapping[str, str]) -> bytes:
    described = {
        "metadata": {k: v for k, v in metadata.items() if k != CHECKSUM_KEY},
        "tensors": [
            [t.name, t.dtype, list(t.shape), t.begin, t.end]
            for t in sorted(tensors, key=_data_order)
        ],
    }
    return json.dumps(described, sort_keys=True, separators=(",", ":")).encode()


def digest(tensors: Iterable[TensorSpec], metadata: Mapping[str, str], data: Iterable) -> str:
    """The checksum of a file: its described header, then each buffer of `data` in order."""
    tensors = tuple(tensors)
    hasher = xxhash.xxh3_64(_canonical(tensors, metadata))
    for buffer in data:
        hasher.update(buffer)
    return CHECKSUM_PREFIX + hasher.hexdigest()


def as_bytes(array: object) -> np.ndarray:
    """A flat uint8 view of an array's bytes (numpy, or mlx through the buffer protocol)."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def layout(arrays: Mapping[str, np.ndarray]) -> list[TensorSpec]:
    """Where each array goes in a new file: widest items first (every tensor stays
    aligned to its item size), then by name."""
    order = sorted(arrays, key=lambda name: (-arrays[name].dtype.itemsize, name))
    specs, position = [], 0
    for name in order:
        array = arrays[name]
        code = dtype_code(array.dtype)
        if code is None:
            raise ValueError(f"{name}: cache files do not hold {array.dtype}")
        specs.append(TensorSpec(name, code, tuple(array.shape), position, position + array.nbytes))
        position += array.nbytes
    return specs


def encode_header(tensors: Iterable[TensorSpec], metadata: Mapping[str, str]) -> bytes:
    """The length prefix and JSON header, padded with spaces so the data is 8-byte aligned."""
    described: dict[str, object] = {"__metadata__": dict(metadata)}
    for t in tensors:
        described[t.name] = {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "data_offsets": [t.begin, t.end],
        }
    text = json.dumps(described, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text
