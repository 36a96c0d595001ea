"""Our own reading of a GGUF file's structure, before any native loader sees it.

mlx's GGUF reader trusts the lengths and offsets a file declares; a crafted or
damaged file can make it read past the end of its mapping and crash the process.
`check_gguf` walks the header with every declared count, length, dimension and
offset checked against the file's size first, so a bad file is refused with a
`GGUFImportError` that says what is wrong, and mlx only ever reads files whose
every byte it will touch lies inside them.

Layout (GGUF v2 and v3, little-endian): magic, version, tensor count, metadata
count; the metadata (key, type, value); one record per tensor (name, dimensions,
ggml type, offset); padding to the alignment; the tensor data.

The metadata values are kept (`GGUFLayout.metadata`) in the shapes mlx's reader
gave them: text as `str`, lists of text as `list[str]`, numbers and lists of
numbers as `mx.array`. The tensors are read by `gguf_tensors`, from the offsets
checked here; no native GGUF reader sees the file at all.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import mlx.core as mx
import numpy as np

from app.engine.errors import UserError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
# Far above any real model (vocabularies hold ~10^5 tokens, models ~10^3 tensors), low
# enough that walking a sparse file's claimed zeros cannot take minutes.
MAX_ITEMS = 1 << 24

# Metadata value types: id -> (struct format, size). 8 is a string, 9 an array.
# Lists of numbers become arrays of the same kind (float64 as float32, as mlx's
# reader did: mlx computes in float32 at most).
_SCALARS = {
    0: ("<B", 1),
    1: ("<b", 1),
    2: ("<H", 2),
    3: ("<h", 2),
    4: ("<I", 4),
    5: ("<i", 4),
    6: ("<f", 4),
    7: ("<?", 1),
    10: ("<Q", 8),
    11: ("<q", 8),
    12: ("<d", 8),
}
_ARRAY_DTYPES = {
    0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
    6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64,
}  # fmt: skip
_STRING = 8
_ARRAY = 9
_UINT32 = 4

# The ggml tensor types we import: id -> (name, elements per block, bytes per block).
# `gguf_tensors` reads each one from the file's bytes (gguf_kquants has the layouts).
TENSOR_TYPES = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    8: ("Q8_0", 32, 34),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    30: ("BF16", 1, 2),
}
# Types llama.cpp writes that we cannot read yet, named so that the refusal says
# which one the file uses.
UNSUPPORTED_TYPES = {
    6: "Q5_0", 7: "Q5_1", 9: "Q8_1", 15: "Q8_K",
    16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S",
    22: "IQ2_S", 23: "IQ4_XS", 27: "I64", 28: "F64", 29: "IQ1_M", 34: "TQ1_0",
    35: "TQ2_0", 39: "MXFP4",
}  # fmt: skip


class GGUFImportError(UserError):
    """The GGUF file cannot be imported; the message says why, in user terms."""


@dataclass(frozen=True)
class TensorRecord:
    name: str
    dims: tuple[int, ...]
    type_name: str
    offset: int  # from the start of the data section
    size: int  # bytes


@dataclass(frozen=True)
class GGUFLayout:
    version: int
    metadata_count: int
    tensors: tuple[TensorRecord, ...]
    alignment: int
    data_start: int
    file_size: int
    metadata: dict = field(default_factory=dict, compare=False, repr=False)


class _Reader:
    """Reads the header, refusing any read that would go past the end of the file."""

    def __init__(self, f: BinaryIO, size: int, label: str) -> None:
        self.f = f
        self.size = size
        self.label = label

    @property
    def position(self) -> int:
        return self.f.tell()

    def fail(self, why: str) -> GGUFImportError:
        return GGUFImportError(f"{self.label} could not be read (damaged or truncated?): {why}")

    def take(self, count: int, what: str) -> bytes:
        if count > self.size - self.position:
            raise self.fail(f"{what} ({count} bytes) runs past the end of the file")
        return self.f.read(count)

    def scalar(self, fmt: str, size: int, what: str):
        return struct.unpack(fmt, self.take(size, what))[0]

    def u32(self, what: str) -> int:
        return self.scalar("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.scalar("<Q", 8, what)

    def string(self, what: str) -> str:
        length = self.u64(f"the length of {what}")
        raw = self.take(length, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8") from None

    def count(self, what: str, smallest_item: int) -> int:
        """A declared number of items, each at least `smallest_item` bytes long."""
        number = self.u64(what)
        if number > MAX_ITEMS:
            raise self.fail(f"{what} ({number}) is more than any model has")
        if number * smallest_item > self.size - self.position:
            raise self.fail(f"{what} ({number}) cannot fit in a file of {self.size} bytes")
        return number


def check_gguf(path: Path) -> GGUFLayout:
    """The file's layout, every part of it checked; `GGUFImportError` if any is wrong."""
    path = Path(path)
    try:
        return _check_file(path)
    except OSError as exc:
        raise GGUFImportError(f"{path} cannot be read: {exc.strerror or exc}") from exc


def _check_file(path: Path) -> GGUFLayout:
    size = path.stat().st_size
    with path.open("rb") as f:
        reader = _Reader(f, size, path.name)
        if size == 0:
            raise GGUFImportError(f"{path.name} is empty, not a GGUF file")
        if size < 4 or f.read(4) != MAGIC:
            raise GGUFImportError(f"{path.name} is not a GGUF file")
        version = reader.u32("the version")
        if version not in VERSIONS:
            raise reader.fail(f"version {version} is not supported (only 2 and 3 are)")
        # The smallest tensor record: an empty name (8), a dimension count, one
        # dimension, a type and an offset (8 + 4 + 8 + 4 + 8); the smallest metadata
        # entry: an empty key (8), a type (4) and a byte.
        tensor_count = reader.count("the tensor count", 32)
        metadata_count = reader.count("the metadata count", 13)
        metadata = _read_metadata(reader, metadata_count)
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        tensors = [_read_tensor(reader, i) for i in range(tensor_count)]
        data_start = -(-reader.position // alignment) * alignment
    _check_tensor_data(reader, tensors, alignment, data_start)
    return GGUFLayout(
        version, metadata_count, tuple(tensors), alignment, data_start, size, metadata
    )


def _read_metadata(reader: _Reader, count: int) -> dict:
    """Reads every metadata entry; `general.alignment` as a plain int, checked."""
    metadata: dict = {}
    for i in range(count):
        key = reader.string(f"metadata key {i}")
        if key in metadata:
            raise reader.fail(f"the metadata key {key!r} appears twice")
        kind = reader.u32(f"the type of {key}")
        value = _read_value(reader, kind, key)
        if key == "general.alignment":
            if kind != _UINT32 or value == 0 or value & (value - 1):
                raise reader.fail(f"general.alignment ({value!r}) is not a power of two")
        elif kind in _SCALARS:
            value = mx.array(np.array(value, dtype=_numpy_dtype(kind)))
        metadata[key] = value
    return metadata


def _numpy_dtype(kind: int) -> np.dtype:
    dtype = np.dtype(_ARRAY_DTYPES[kind])
    return np.dtype(np.float32) if dtype == np.float64 else dtype


def _read_value(reader: _Reader, kind: int, key: str):
    if kind in _SCALARS:
        fmt, size = _SCALARS[kind]
        return reader.scalar(fmt, size, f"the value of {key}")
    if kind == _STRING:
        return reader.string(f"the value of {key}")
    if kind != _ARRAY:
        raise reader.fail(f"{key} has an unknown value type {kind}")
    item_kind = reader.u32(f"the item type of {key}")
    if item_kind == _STRING:
        length = reader.count(f"the length of {key}", 8)
        return [reader.string(f"item {i} of {key}") for i in range(length)]
    if item_kind not in _SCALARS:
        what = "arrays of arrays" if item_kind == _ARRAY else f"item type {item_kind}"
        raise reader.fail(f"{key} holds {what}, which is not supported")
    item_size = _SCALARS[item_kind][1]
    length = reader.count(f"the length of {key}", item_size)
    raw = reader.take(length * item_size, f"the items of {key}")
    items = np.frombuffer(raw, dtype=np.dtype(_ARRAY_DTYPES[item_kind]).newbyteorder("<"))
    return mx.array(items.astype(_numpy_dtype(item_kind)))


def _read_tensor(reader: _Reader, index: int) -> TensorRecord:
    name = reader.string(f"the name of tensor {index}")
    if not name:
        raise reader.fail(f"tensor {index} has no name")
    n_dims = reader.u32(f"the dimension count of {name}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise reader.fail(f"tensor {name} has {n_dims} dimensions (1 to {MAX_DIMS} are allowed)")
    dims = tuple(reader.u64(f"a dimension of {name}") for _ in range(n_dims))
    if min(dims) < 1:
        raise reader.fail(f"tensor {name} has an empty dimension {list(dims)}")
    type_id = reader.u32(f"the type of {name}")
    if type_id in UNSUPPORTED_TYPES:
        supported = ", ".join(t[0] for t in TENSOR_TYPES.values() if not t[0].startswith("I"))
        raise GGUFImportError(
            f"{reader.label} stores tensor {name} as {UNSUPPORTED_TYPES[type_id]}, which cannot "
            f"be imported yet (the types that can: {supported}); try a Q4_K_M, Q4_0 or Q8_0 file"
        )
    if type_id not in TENSOR_TYPES:
        raise reader.fail(f"tensor {name} has ggml type {type_id}, which cannot be imported")
    type_name, block, block_bytes = TENSOR_TYPES[type_id]
    if dims[0] % block:
        raise reader.fail(f"tensor {name}'s rows ({dims[0]}) are not whole {type_name} blocks")
    elements = 1
    for dim in dims:
        elements *= dim
    offset = reader.u64(f"the data offset of {name}")
    return TensorRecord(name, dims, type_name, offset, elements // block * block_bytes)


def _check_tensor_data(
    reader: _Reader, tensors: list[TensorRecord], alignment: int, data_start: int
) -> None:
    """Every tensor's bytes aligned, inside the file, and apart from every other's."""
    names: set[str] = set()
    end_of_previous, previous = 0, None
    for tensor in sorted(tensors, key=lambda t: t.offset):
        if tensor.name in names:
            raise reader.fail(f"the tensor name {tensor.name!r} appears twice")
        names.add(tensor.name)
        if tensor.offset % alignment:
            raise reader.fail(f"tensor {tensor.name}'s data is not aligned to {alignment} bytes")
        end = data_start + tensor.offset + tensor.size
        if end > reader.size:
            raise reader.fail(
                f"tensor {tensor.name}'s data ends at byte {end}, past the end of the file "
                f"({reader.size} bytes; truncated?)"
            )
        if previous is not None and tensor.offset < end_of_previous:
            raise reader.fail(f"tensors {previous} and {tensor.name} overlap")
        end_of_previous, previous = tensor.offset + tensor.size, tensor.name
