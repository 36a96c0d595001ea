"""A GGUF file taken apart into its fields and put back together, for crafting bad files.

Written apart from app/engine/gguf_check.py on purpose (from the GGUF layout, not
from our reader), so a test does not share the reader's mistakes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY, UINT32 = 8, 9, 4


def gguf_string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


@dataclass
class Tensor:
    name: bytes
    dims: list[int]
    ggml_type: int
    offset: int

    def to_bytes(self) -> bytes:
        out = gguf_string(self.name) + struct.pack("<I", len(self.dims))
        out += b"".join(struct.pack("<Q", d) for d in self.dims)
        return out + struct.pack("<IQ", self.ggml_type, self.offset)


@dataclass
class GGUF:
    version: int
    metadata: list[tuple[bytes, int, bytes]]  # key, value type, the value's encoded bytes
    tensors: list[Tensor]
    data: bytes
    alignment: int = 32
    magic: bytes = b"GGUF"
    counts: tuple[int, int] | None = None  # (tensors, metadata) to declare instead
    extra: bytes = field(default=b"")  # appended after the data

    def to_bytes(self) -> bytes:
        tensors, entries = self.counts or (len(self.tensors), len(self.metadata))
        out = self.magic + struct.pack("<IQQ", self.version, tensors, entries)
        for key, kind, value in self.metadata:
            out += gguf_string(key) + struct.pack("<I", kind) + value
        out += b"".join(t.to_bytes() for t in self.tensors)
        out += b"\0" * (-len(out) % self.alignment)
        return out + self.data + self.extra

    def value(self, key: str) -> bytes:
        return next(v for k, _, v in self.metadata if k == key.encode())

    def set(self, key: str, kind: int, value: bytes) -> None:
        self.metadata = [(k, t, v) for k, t, v in self.metadata if k != key.encode()]
        self.metadata.append((key.encode(), kind, value))

    def tensor(self, name: str) -> Tensor:
        return next(t for t in self.tensors if t.name == name.encode())


def parse(data: bytes) -> GGUF:
    position = 0

    def take(n: int) -> bytes:
        nonlocal position
        position += n
        return data[position - n : position]

    def u(fmt: str) -> int:
        return struct.unpack(fmt, take(struct.calcsize(fmt)))[0]

    def string() -> bytes:
        return take(u("<Q"))

    def value(kind: int) -> bytes:
        start = position
        if kind in SCALAR_SIZES:
            take(SCALAR_SIZES[kind])
        elif kind == STRING:
            string()
        else:
            item, count = u("<I"), u("<Q")
            for _ in range(count):
                value(item)
        return data[start:position]

    magic, version = take(4), u("<I")
    tensor_count, entry_count = u("<Q"), u("<Q")
    metadata = []
    for _ in range(entry_count):
        key, kind = string(), u("<I")
        metadata.append((key, kind, value(kind)))
    tensors = []
    for _ in range(tensor_count):
        name, n_dims = string(), u("<I")
        dims = [u("<Q") for _ in range(n_dims)]
        tensors.append(Tensor(name, dims, u("<I"), u("<Q")))
    position += -position % 32
    return GGUF(version, metadata, tensors, data[position:], magic=magic)
