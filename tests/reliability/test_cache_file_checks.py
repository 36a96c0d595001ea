"""Crafted cache files, read through `read_file`: each is refused with a reason before
its data is read, or comes back exactly as written. No model needed."""

from __future__ import annotations

import json
import os
import resource
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from sessions.cachefiles import CacheRejected, load_numpy, read_file, write_file
from sessions.chunkio import FORMAT_VERSION

TENSORS = {
    "0.k.0": np.arange(2 * 4 * 8, dtype=np.float16).reshape(1, 2, 4, 8),
    "0.v.0": -np.arange(2 * 4 * 8, dtype=np.float16).reshape(1, 2, 4, 8),
    "0.k.1": np.arange(16, dtype=np.uint32).reshape(2, 8),
}
EXPECT = {"model": "m1", "key": "ab" * 20}
SHAPES = {name: array.shape for name, array in TENSORS.items()}


def load_mlx(path: Path):
    tensors, metadata = mx.load(str(path), return_metadata=True)
    return tensors, metadata


@pytest.fixture
def chunk(tmp_path) -> Path:
    path = tmp_path / "chunk.safetensors"
    write_file(path, TENSORS, EXPECT)
    return path


def split(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def join(path: Path, header: dict, body: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + body)


def test_a_written_file_reads_back_exactly_with_either_loader_and_other_readers(chunk):
    for load in (load_numpy, load_mlx):
        tensors, metadata = read_file(chunk, EXPECT, load, shapes=SHAPES)
        for name, array in TENSORS.items():
            got = np.asarray(tensors[name])
            assert got.dtype == array.dtype and np.array_equal(got, array)
        assert metadata["reprise.format"] == FORMAT_VERSION
    # Still a plain safetensors file: safetensors itself reads it.
    assert np.array_equal(load_file(str(chunk))["0.k.1"], TENSORS["0.k.1"])


def test_a_relabelled_dtype_is_caught_by_the_checksum(chunk):
    """float16 -> uint16: same size, so only a checksum over the header can tell."""
    header, body = split(chunk)
    header["0.k.0"]["dtype"] = "U16"
    join(chunk, header, body)
    for load in (load_numpy, load_mlx):
        with pytest.raises(CacheRejected, match="checksum mismatch"):
            read_file(chunk, EXPECT, load)


def test_a_changed_metadata_value_is_caught_by_the_checksum(chunk):
    header, body = split(chunk)
    header["__metadata__"]["classes"] = '["os.system"]'
    join(chunk, header, body)
    with pytest.raises(CacheRejected, match="checksum mismatch"):
        read_file(chunk, EXPECT)


def test_swapped_tensor_data_is_caught(chunk):
    header, body = split(chunk)
    header["0.k.0"]["data_offsets"], header["0.v.0"]["data_offsets"] = (
        header["0.v.0"]["data_offsets"],
        header["0.k.0"]["data_offsets"],
    )
    join(chunk, header, body)
    with pytest.raises(CacheRejected, match="checksum mismatch"):
        read_file(chunk, EXPECT)


def _edit(name: str, entry: dict) -> None:
    """One crafted header per case: what a damaged or hostile file may declare."""
    t = entry["0.k.0"]
    if name == "overlap":
        t["data_offsets"] = [t["data_offsets"][0] + 8, t["data_offsets"][1] + 8]
    elif name == "gap":
        entry["0.k.1"]["data_offsets"][0] -= 8
    elif name == "size against shape":
        t["shape"] = [1, 2, 4, 9]
    elif name == "dtype not allowed":
        t["dtype"] = "F64"
    elif name == "negative dimension":
        t["shape"] = [1, -2, 4, 8]
    elif name == "float dimension":
        t["shape"] = [1, 2.0, 4, 8]
    elif name == "too many dimensions":
        t["shape"] = [1] * 40
    elif name == "offsets reversed":
        t["data_offsets"] = t["data_offsets"][::-1]
    elif name == "extra field":
        t["more"] = 1
    elif name == "metadata not text":
        entry["__metadata__"]["layers"] = 2
    elif name == "not an object":
        entry["0.k.0"] = [1, 2, 3]


@pytest.mark.parametrize(
    "case",
    [
        "overlap",
        "gap",
        "size against shape",
        "dtype not allowed",
        "negative dimension",
        "float dimension",
        "too many dimensions",
        "offsets reversed",
        "extra field",
        "metadata not text",
        "not an object",
    ],
)
def test_a_header_that_does_not_add_up_is_refused_before_any_loader(chunk, case):
    header, body = split(chunk)
    _edit(case, header)
    join(chunk, header, body)
    calls = []

    def loader(path):
        calls.append(path)
        return load_mlx(path)

    with pytest.raises(CacheRejected, match="unreadable file"):
        read_file(chunk, EXPECT, loader)
    assert calls == []  # mlx never saw the file


def framed(header: bytes, body: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header)) + header + body


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"", "shorter than a header"),
        (struct.pack("<Q", 2**40) + b"{}", "a header of"),
        (struct.pack("<Q", 500) + b"{}", "runs past the end"),
        (framed(b"\xff\xfe{}"), "not JSON"),
        (framed(b"[]"), "not a JSON object"),
        (framed(b"[" * 100_000 + b"]" * 100_000), "not JSON"),
        (
            framed(b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{}}', b"\0" * 4),
            "twice",
        ),
        (framed(b'{"__metadata__":NaN}'), "not JSON"),
        (framed(b'{"a":{"dtype":"F32","shape":[1e400],"data_offsets":[0,4]}}', b"\0" * 4), "shape"),
        (
            framed(b'{"a":{"dtype":"F32","shape":[' + b"9" * 5000 + b'],"data_offsets":[0,4]}}'),
            "JSON",
        ),
    ],
)
def test_malformed_headers_are_refused(tmp_path, raw, reason):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(raw)
    with pytest.raises(CacheRejected, match=reason):
        read_file(path, {})


def test_a_sparse_file_claiming_4_gb_is_refused_without_reading_it(tmp_path):
    """The header is honest about a 4 GiB tensor and the (sparse) file is that long: only
    the expected shapes, or the size the index recorded, can refuse it, and they must do
    so before the data is read."""
    path = tmp_path / "huge.safetensors"
    elements = 2**30
    header = {
        "__metadata__": {"reprise.format": FORMAT_VERSION, **EXPECT, "checksum": "xxh3-64:0"},
        "0.k.0": {"dtype": "F32", "shape": [1, 1, elements, 1], "data_offsets": [0, 4 * elements]},
    }
    join(path, header, b"")
    os.truncate(path, path.stat().st_size + 4 * elements)
    assert path.stat().st_blocks * 512 < 1 << 20  # really sparse: nothing on disk
    io_before, rss_before = _bytes_read(), _peak_rss()
    with pytest.raises(CacheRejected, match="wrong shape"):
        read_file(path, EXPECT, shapes={"0.k.0": (1, 1, 4, 1)})
    with pytest.raises(CacheRejected, match="file size"):
        read_file(path, EXPECT, size=4096)
    assert _bytes_read() - io_before < 1 << 20
    assert _peak_rss() - rss_before < 256 << 20


def _bytes_read() -> int:
    """Bytes this process has read through system calls (Linux)."""
    try:
        text = Path("/proc/self/io").read_text()
    except OSError:
        pytest.skip("no /proc/self/io here")
    return int(next(line for line in text.splitlines() if line.startswith("rchar")).split()[1])


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def test_a_file_of_the_previous_format_is_a_rejection_not_a_crash(tmp_path):
    """Format 1 was written by safetensors with a CRC-32 of the tensors only."""
    path = tmp_path / "old.safetensors"
    save_file(
        TENSORS, str(path), metadata={**EXPECT, "reprise.format": "1", "checksum": "1f2e3d4c"}
    )
    with pytest.raises(CacheRejected, match="not a Reprise cache file of this version"):
        read_file(path, EXPECT)


def test_expectations_are_checked_from_the_header(chunk):
    with pytest.raises(CacheRejected, match="model does not match"):
        read_file(chunk, {**EXPECT, "model": "another"})
    with pytest.raises(CacheRejected, match="wrong tensors"):
        read_file(chunk, EXPECT, shapes={"0.k.0": SHAPES["0.k.0"]})
    with pytest.raises(CacheRejected, match="wrong shape"):
        read_file(chunk, EXPECT, shapes={**SHAPES, "0.k.1": (2, 9)})


def test_a_file_that_changes_under_the_loader_is_caught(chunk):
    """What the loader returns is checked against the header we read, then checksummed."""

    def shifty(path):
        tensors, metadata = load_mlx(path)
        return {**tensors, "0.k.1": tensors["0.k.1"] + 1}, metadata

    with pytest.raises(CacheRejected, match="checksum mismatch"):
        read_file(chunk, EXPECT, shifty)

    def other(path):
        tensors, metadata = load_mlx(path)
        return {**tensors, "0.k.1": tensors["0.k.1"].astype(mx.float32)}, metadata

    with pytest.raises(CacheRejected, match=r"saw 0\.k\.1 differently"):
        read_file(chunk, EXPECT, other)

    def failing(path):
        raise RuntimeError("[load] the native loader gave up")

    with pytest.raises(CacheRejected, match="native loader gave up"):
        read_file(chunk, EXPECT, failing)
