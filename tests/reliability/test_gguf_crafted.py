"""Crafted GGUF files, each damaged in one field, imported for real: every one is refused by
our reader with a message naming what is wrong, before mlx reads it (some of these make
mlx's own reader crash the process: a huge tensor count segfaults it, nine dimensions
abort it), and nothing is left in the models folder."""

from __future__ import annotations

import struct

import pytest
from gguf_bytes import ARRAY, GGUF, STRING, UINT32, parse

import tiny
from app.engine.gguf_check import check_gguf
from app.engine.gguf_import import GGUFImportError, import_gguf

EMBED = "token_embd.weight"
NORM = "output_norm.weight"


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> bytes:
    return tiny.write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf").read_bytes()


def _tensor(g: GGUF, tensor_name: str, **changes) -> None:
    for attribute, value in changes.items():
        setattr(g.tensor(tensor_name), attribute, value)


def _first_key(g: GGUF, raw: bytes) -> None:
    _, kind, value = g.metadata[0]
    g.metadata[0] = (raw, kind, value)


CASES = {
    "wrong magic": (lambda g: setattr(g, "magic", b"GGML"), "not a GGUF file"),
    "version 1": (lambda g: setattr(g, "version", 1), "version 1 is not supported"),
    "version 2^32-1": (lambda g: setattr(g, "version", 2**32 - 1), "is not supported"),
    "tensor count 2^40": (
        lambda g: setattr(g, "counts", (2**40, len(g.metadata))),
        r"tensor count \(1099511627776\)",
    ),
    "tensor count 2^64-1": (
        lambda g: setattr(g, "counts", (2**64 - 1, len(g.metadata))),
        "tensor count",
    ),
    "metadata count 2^40": (
        lambda g: setattr(g, "counts", (len(g.tensors), 2**40)),
        "metadata count",
    ),
    "metadata count one too many": (
        lambda g: setattr(g, "counts", (len(g.tensors), len(g.metadata) + 1)),
        "damaged",
    ),
    "key not UTF-8": (lambda g: _first_key(g, b"\xff\xfe"), "not valid UTF-8"),
    "duplicate key": (lambda g: g.metadata.append(g.metadata[0]), "appears twice"),
    "unknown value type": (
        lambda g: g.set("x.odd", 99, b"\0" * 8),
        "unknown value type 99",
    ),
    "string value 2^62 long": (
        lambda g: g.set("general.name", STRING, struct.pack("<Q", 2**62)),
        "runs past the end",
    ),
    "string array of 2^60": (
        lambda g: g.set("tokenizer.ggml.tokens", ARRAY, struct.pack("<IQ", STRING, 2**60)),
        "more than any model has",
    ),
    "string array longer than the file": (
        lambda g: g.set("tokenizer.ggml.tokens", ARRAY, struct.pack("<IQ", STRING, 2**20)),
        "cannot fit",
    ),
    "number array longer than the file": (
        lambda g: g.set("x.numbers", ARRAY, struct.pack("<IQ", UINT32, 2**22)),
        "cannot fit",
    ),
    "array of arrays": (
        lambda g: g.set("x.nested", ARRAY, struct.pack("<IQ", ARRAY, 0)),
        "arrays of arrays",
    ),
    "alignment 3": (
        lambda g: g.set("general.alignment", UINT32, struct.pack("<I", 3)),
        "not a power of two",
    ),
    "alignment 0": (
        lambda g: g.set("general.alignment", UINT32, struct.pack("<I", 0)),
        "not a power of two",
    ),
    "no dimensions": (lambda g: _tensor(g, NORM, dims=[]), "0 dimensions"),
    "five dimensions": (lambda g: _tensor(g, NORM, dims=[128, 1, 1, 1, 1]), "5 dimensions"),
    "nine dimensions": (lambda g: _tensor(g, NORM, dims=[128, *[1] * 8]), "9 dimensions"),
    "an empty dimension": (lambda g: _tensor(g, EMBED, dims=[128, 0]), "empty dimension"),
    "a dimension of 2^40": (lambda g: _tensor(g, EMBED, dims=[128, 2**40]), "past the end"),
    "a dimension of 2^64-1": (
        lambda g: _tensor(g, EMBED, dims=[2**64 - 1, 2**64 - 1]),
        "past the end",
    ),
    "Q5_0 (unsupported type)": (
        lambda g: _tensor(g, NORM, ggml_type=6),
        "stores tensor .* as Q5_0, which cannot be imported yet",
    ),
    "Q4_K rows not whole blocks": (
        lambda g: _tensor(g, NORM, ggml_type=12),
        r"rows \(\d+\) are not whole Q4_K blocks",
    ),
    "type 99": (lambda g: _tensor(g, NORM, ggml_type=99), "ggml type 99"),
    "Q8_0 rows not whole blocks": (
        lambda g: _tensor(g, NORM, ggml_type=8, dims=[100]),
        "not whole Q8_0 blocks",
    ),
    "offset not aligned": (lambda g: _tensor(g, NORM, offset=g.tensor(NORM).offset + 4), "aligned"),
    "offset past the end": (lambda g: _tensor(g, EMBED, offset=2**40), "past the end"),
    "tensors overlap": (lambda g: _tensor(g, NORM, offset=g.tensor(EMBED).offset), "overlap"),
    "duplicate tensor name": (
        lambda g: _tensor(g, NORM, name=EMBED.encode()),
        "appears twice",
    ),
    "empty tensor name": (lambda g: _tensor(g, NORM, name=b""), "has no name"),
    "data truncated": (lambda g: setattr(g, "data", g.data[:-1]), "truncated"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_crafted_gguf_is_refused_by_our_reader(valid, tmp_path, case):
    damage, message = CASES[case]
    g = parse(valid)
    damage(g)
    path = _write(tmp_path / "crafted.gguf", g.to_bytes())
    with pytest.raises(GGUFImportError, match=message) as refused:
        check_gguf(path)
    assert refused.value.args[0].startswith("crafted.gguf")
    with pytest.raises(GGUFImportError):
        import_gguf(path, tmp_path / "models", "crafted")
    assert not (tmp_path / "models").exists() or list((tmp_path / "models").iterdir()) == []


def test_a_key_length_past_the_end_is_refused(valid, tmp_path):
    first_key = 24  # after the magic, the version and the two counts
    data = valid[:first_key] + struct.pack("<Q", 2**62) + valid[first_key + 8 :]
    with pytest.raises(
        GGUFImportError, match=r"metadata key 0 \(4611686018427387904 bytes\) runs past the end"
    ):
        check_gguf(_write(tmp_path / "crafted.gguf", data))


def test_truncated_at_every_part_of_the_header_is_refused(valid, tmp_path):
    layout = check_gguf(_write(tmp_path / "whole.gguf", valid))
    cuts = sorted({0, 3, 4, 8, 16, 23, 24, 25, 100, 1000, layout.data_start - 1})
    cuts += [layout.data_start, len(valid) // 2, len(valid) - 1]
    for cut in cuts:
        with pytest.raises(GGUFImportError):
            check_gguf(_write(tmp_path / f"cut{cut}.gguf", valid[:cut]))


def test_the_valid_file_passes_and_its_layout_is_read(valid, tmp_path):
    layout = check_gguf(_write(tmp_path / "tiny.gguf", valid))
    assert layout.version == 3 and layout.alignment == 32
    assert len(layout.tensors) == len(tiny.tensors())
    embed = next(t for t in layout.tensors if t.name == EMBED)
    assert embed.dims == (tiny.HIDDEN, len(tiny.vocabulary())) and embed.type_name == "F16"
    assert max(layout.data_start + t.offset + t.size for t in layout.tensors) == len(valid)


def test_an_unreadable_file_is_a_clear_error(tmp_path):
    folder = tmp_path / "a-folder.gguf"
    folder.mkdir()
    with pytest.raises(GGUFImportError, match="cannot be read"):
        check_gguf(folder)


def _write(path, data: bytes):
    path.write_bytes(data)
    return path
