"""Fuzzed cache files: a real chunk file from the tiny model, mutated hundreds of ways
(header bytes, data bytes, truncation, sparse extension, crafted headers), each read
through `read_file` with both loaders. Every outcome is the exact original tensors or a
`CacheRejected`, never another exception, never gigabytes read.

REPRISE_FUZZ_TRIALS sets the number of trials (default 400); REPRISE_FUZZ_SEED the seed.
"""

from __future__ import annotations

import collections
import json
import os
import random
import resource
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from app.engine.conversation import ConversationEngine, TurnOptions
from app.engine.generation import SamplingSettings
from sessions.cachefiles import CacheIndex, CacheRejected, load_numpy, path_from_url, read_file
from sessions.db import open_db

TRIALS = int(os.environ.get("REPRISE_FUZZ_TRIALS", "400"))
SEED = int(os.environ.get("REPRISE_FUZZ_SEED", "0"))
GIB = 1 << 30


def load_mlx(path: Path):
    """As the engine reads a chunk: straight into mlx memory."""
    tensors, metadata = mx.load(str(path), return_metadata=True)
    mx.eval(list(tensors.values()))
    return tensors, metadata


@pytest.fixture
def real_chunk(tiny_model, tmp_path) -> tuple[bytes, dict, dict]:
    """The bytes of a chunk file the engine wrote, its expected metadata and tensors."""
    engine = ConversationEngine(open_db(), tiny_model, chunk_tokens=16)
    conversation = engine.store.create(tiny_model.name)
    options = TurnOptions(sampling=SamplingSettings.greedy(8))
    list(engine.send(conversation.id, "a message long enough for a chunk or two", options))
    index = CacheIndex(open_db())
    row = index.chunk(index.conversation(conversation.id).chunk_keys[0])
    path = path_from_url(row["url"])
    tensors, metadata = read_file(path, {})
    expect = {k: metadata[k] for k in ("model", "kv_format", "key", "token_start", "token_end")}
    return path.read_bytes(), expect, tensors


def split(data: bytes) -> tuple[dict, bytes]:
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def join(header: dict, body: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body


def mutate(data: bytes, rng: random.Random) -> tuple[str, bytes, int]:
    """(kind, mutated bytes, bytes to extend the file by as a sparse hole)."""
    (length,) = struct.unpack("<Q", data[:8])
    kind = rng.choice(
        [
            "header byte",
            "header bytes",
            "length field",
            "data byte",
            "data bytes",
            "truncate",
            "sparse extension",
            "relabel dtype",
            "change shape",
            "shift offsets",
            "claim 4 GiB",
            "metadata value",
            "insert byte",
        ]
    )
    out = bytearray(data)
    extend = 0
    if kind == "header byte":
        out[rng.randrange(8, 8 + length)] = rng.randrange(256)
    elif kind == "header bytes":
        for _ in range(rng.randint(2, 16)):
            out[rng.randrange(8, 8 + length)] = rng.randrange(256)
    elif kind == "length field":
        out[rng.randrange(0, 8)] = rng.randrange(256)
    elif kind in ("data byte", "data bytes"):
        for _ in range(1 if kind == "data byte" else rng.randint(2, 64)):
            out[rng.randrange(8 + length, len(out))] ^= 1 << rng.randrange(8)
    elif kind == "truncate":
        del out[rng.randrange(0, len(out)) :]
    elif kind == "sparse extension":
        extend = rng.choice([1, 4096, 1 << 20, 4 * GIB])
    elif kind == "insert byte":
        out.insert(rng.randrange(0, len(out)), rng.randrange(256))
    else:
        header, body = split(data)
        extend = mutate_header(header, kind, rng)
        out = bytearray(join(header, body))
    return kind, bytes(out), extend


def mutate_header(header: dict, kind: str, rng: random.Random) -> int:
    """Change one tensor entry or metadata value in place; the bytes of sparse hole to add."""
    extend = 0
    names = [n for n in header if n != "__metadata__"]
    entry = header[rng.choice(names)]
    if kind == "relabel dtype":
        entry["dtype"] = rng.choice(["F32", "F16", "U32", "U16", "I32", "U8", "BF16", "F64"])
    elif kind == "change shape":
        dims = entry["shape"]
        dims[rng.randrange(len(dims))] = rng.choice([0, 1, 2, 3, 2**31, -1])
    elif kind == "shift offsets":
        entry["data_offsets"][rng.randrange(2)] += rng.choice([-8, -4, -2, 2, 4, 8])
    elif kind == "claim 4 GiB":  # an honest header over a sparse file of that size
        rest = entry["shape"][:-1]
        size = 4 if entry["dtype"] in ("F32", "U32", "I32") else 2
        entry["shape"] = [*[1] * len(rest), 4 * GIB // size]
        begin = entry["data_offsets"][0]
        growth = 4 * GIB - (entry["data_offsets"][1] - begin)
        entry["data_offsets"][1] = begin + 4 * GIB
        for other in names:  # everything after it moves along
            offsets = header[other]["data_offsets"]
            if other != "__metadata__" and header[other] is not entry and offsets[0] >= begin:
                header[other]["data_offsets"] = [o + growth for o in offsets]
        extend = growth
    elif kind == "metadata value":
        key = rng.choice(sorted(header["__metadata__"]))
        header["__metadata__"][key] += rng.choice(["0", " ", "x"])
    return extend


def same(tensors: dict, original: dict) -> bool:
    if set(tensors) != set(original):
        return False
    for name, array in original.items():
        got = np.asarray(tensors[name])
        if got.dtype != array.dtype or not np.array_equal(got, array):
            return False
    return True


def test_fuzzed_chunk_files_read_exactly_or_are_rejected(real_chunk, tmp_path):
    data, expect, original = real_chunk
    shapes = {name: array.shape for name, array in original.items()}
    rng = random.Random(SEED)
    path = tmp_path / "fuzzed.safetensors"
    outcomes: collections.Counter = collections.Counter()
    failures = []
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for trial in range(TRIALS):
        kind, mutated, extend = mutate(data, rng)
        path.write_bytes(mutated)
        if extend:
            os.truncate(path, len(mutated) + extend)
        load = load_numpy if trial % 2 else load_mlx
        # As the index reads (the size it wrote, the shapes the model needs), or bare;
        # a file of gigabytes is only ever read with those expectations, as the app does.
        checked = trial % 4 < 2 or extend >= GIB
        try:
            tensors, _ = read_file(
                path,
                expect,
                load,
                shapes=shapes if checked else None,
                size=len(data) if checked else None,
            )
        except CacheRejected as exc:
            outcomes[(kind, "rejected")] += 1
            assert exc.reason
            continue
        except Exception as exc:  # the failure this test exists to find
            failures.append((trial, kind, repr(exc)))
            continue
        if same(tensors, original):
            outcomes[(kind, "exact")] += 1
        else:
            failures.append((trial, kind, "accepted with other tensors"))
    peak_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before
    print(f"\nfuzz: {TRIALS} trials, seed {SEED}")
    for (kind, outcome), count in sorted(outcomes.items()):
        print(f"  {kind:18} {outcome:9} {count}")
    assert failures == []
    assert sum(outcomes.values()) == TRIALS
    assert peak_growth * 1024 < 512 << 20  # no trial read a claimed 4 GiB
    rejected_kinds = {kind for kind, outcome in outcomes if outcome == "rejected"}
    assert {"data byte", "relabel dtype", "truncate", "claim 4 GiB"} <= rejected_kinds
