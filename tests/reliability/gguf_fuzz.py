"""Fuzzed GGUF files: the tiny model's GGUF, mutated many ways, each imported for real.

The base file is the tiny llama with an MLP 256 wide, so that its down projections
can be K-quant matrices (rows of whole 256-value super-blocks): layer 0's is Q6_K,
layer 1's Q4_K, written with the `gguf` package; every other tensor is as `tiny`
writes it. So the block decoders see damaged blocks too, not only float tensors.

Run as a script (by test_gguf_fuzz.py, in a child process of its own, so that a crash
is a failed test that names its trial rather than the end of pytest). Each trial
ends in an imported model or a `GGUFImportError`; anything else is a failure. Before
each trial its number and kind go to stderr, so a crash names the file that caused it.

    python tests/reliability/gguf_fuzz.py TRIALS SEED WORKDIR  -> one JSON line on stdout
"""

from __future__ import annotations

import collections
import json
import random
import shutil
import struct
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]

from gguf_bytes import GGUF, STRING, parse  # noqa: E402

import app.engine  # noqa: E402, F401  (OpenBLAS before mlx)
import tiny  # noqa: E402
from app.engine.gguf_import import GGUFImportError, import_gguf  # noqa: E402

BIG = [0, 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**63, 2**64 - 1]
K_FFN = 256
# K-quant type -> (its GGML type id, bytes per block of 256, where its float16 super-block
# scale d sits, a small d (2^-14, 2^-12) so that the random blocks are sane weights)
K_QUANTS = {"Q6_K": (14, 210, 208, b"\x00\x04"), "Q4_K": (12, 144, 0, b"\x00\x0c\x00\x0c")}
F16_SPECIALS = [0x7C00, 0xFC00, 0x7E00, 0x7BFF, 0x0001, 0x0000]  # inf, -inf, NaN, max, tiny, 0


def base_file(path: Path) -> bytes:
    # imported here, after app.engine (OpenBLAS before mlx), which import sorting would undo
    import gguf_models
    import mlx.core as mx
    import numpy as np

    arrays = tiny.tensors()
    rng = np.random.default_rng(0)
    raw = {}
    for i, (type_name, (_, size, at, scale)) in enumerate(K_QUANTS.items()):
        for part in ("ffn_gate", "ffn_up"):
            arrays[f"blk.{i}.{part}.weight"] = (
                0.2 * mx.random.normal((K_FFN, tiny.HIDDEN))
            ).astype(mx.float16)
        blocks = rng.integers(0, 256, size=(tiny.HIDDEN, K_FFN // 256, size), dtype=np.uint8)
        blocks[:, :, at : at + len(scale)] = np.frombuffer(scale, dtype=np.uint8)
        raw[f"blk.{i}.ffn_down.weight"] = (blocks.reshape(tiny.HIDDEN, -1), type_name)
    meta = tiny.metadata(**{"llama.feed_forward_length": mx.array(K_FFN, dtype=mx.uint32)})
    gguf_models.write_with_gguf_package(path, "llama", arrays, raw, meta)
    return path.read_bytes()


def mutate_k_quant(g: GGUF, out: bytearray, header_end: int, rng: random.Random) -> None:
    """Random bytes inside a K-quant matrix's blocks, or a special value as one block's scale."""
    kinds = {type_id: (size, at) for type_id, size, at, _ in K_QUANTS.values()}
    tensor = rng.choice([t for t in g.tensors if t.ggml_type in kinds])
    size, at = kinds[tensor.ggml_type]
    start = header_end + tensor.offset
    blocks = tensor.dims[0] // 256 * tensor.dims[1]
    if rng.random() < 0.5:
        poke(out, start + rng.randrange(blocks) * size + at, "<H", rng.choice(F16_SPECIALS))
    else:
        for _ in range(rng.randint(1, 64)):
            out[start + rng.randrange(blocks * size)] = rng.randrange(256)


def entry_offsets(g: GGUF) -> list[int]:
    """Where each metadata entry's key length field starts in `g.to_bytes()`."""
    offsets, position = [], 24
    for key, _, value in g.metadata:
        offsets.append(position)
        position += 8 + len(key) + 4 + len(value)
    return offsets


def poke(data: bytearray, at: int, fmt: str, value: int) -> None:
    size = struct.calcsize(fmt)
    if at + size <= len(data):
        data[at : at + size] = struct.pack(fmt, value)


def mutate_structure(g: GGUF, kind: str, rng: random.Random) -> None:
    tensor = rng.choice(g.tensors)
    if kind == "count":
        n_tensors, n_entries = len(g.tensors), len(g.metadata)
        pick = [*BIG, n_tensors - 1, n_tensors + 1, n_entries - 1, n_entries + 1]
        g.counts = (
            (rng.choice(pick), n_entries) if rng.random() < 0.5 else (n_tensors, rng.choice(pick))
        )
    elif kind == "tensor dims":
        dims = [rng.choice([*BIG, 2, 3, 32, 128]) for _ in range(rng.choice([0, 1, 2, 3, 5, 9]))]
        tensor.dims = dims if dims and rng.random() < 0.5 else [*tensor.dims[:-1], rng.choice(BIG)]
    elif kind == "tensor type":
        tensor.ggml_type = rng.choice([*range(0, 40), 2**32 - 1])
    elif kind == "tensor offset":
        tensor.offset = max(0, tensor.offset + rng.choice([-32, -1, 1, 32, 4096, 2**40]))
    elif kind == "tensor name":
        tensor.name = rng.choice([b"", b"\xff", g.tensors[0].name, b"blk.99.attn_q.weight"])
    elif kind == "value type":
        i = rng.randrange(len(g.metadata))
        key, _, value = g.metadata[i]
        g.metadata[i] = (key, rng.choice([*range(0, 14), 2**32 - 1]), value)
    elif kind == "token text":
        tokens = g.value("tokenizer.ggml.tokens")
        raw = bytearray(tokens)
        raw[rng.randrange(12, len(raw))] = rng.randrange(256)
        g.set("tokenizer.ggml.tokens", 9, bytes(raw))
    elif kind == "merges":
        bad = rng.choice(["x y", "Ġ", "a b c", "", "\u00e9 \u00e8"])
        merges = [bad] * rng.randint(1, 3)
        items = b"".join(struct.pack("<Q", len(m.encode())) + m.encode() for m in merges)
        g.set("tokenizer.ggml.merges", 9, struct.pack("<IQ", STRING, len(merges)) + items)
    elif kind == "alignment":
        g.set(
            "general.alignment",
            rng.choice([4, 5, 6]),
            struct.pack("<I", rng.choice([0, 1, 3, 16, 64, 2**31])),
        )
    elif kind == "drop key":
        del g.metadata[rng.randrange(len(g.metadata))]


def mutate(valid: bytes, rng: random.Random) -> tuple[str, bytes, int]:
    """(kind, the mutated bytes, how far to extend the file as a sparse hole)."""
    g = parse(valid)
    header_end = len(valid) - len(g.data)
    kind = rng.choice(
        [
            "header byte",
            "header bytes",
            "data bytes",
            "k-quant bytes",
            "truncate",
            "insert byte",
            "delete byte",
            "length field",
            "sparse extension",
            "count",
            "tensor dims",
            "tensor type",
            "tensor offset",
            "tensor name",
            "value type",
            "token text",
            "merges",
            "alignment",
            "drop key",
        ]
    )
    out = bytearray(valid)
    extend = 0
    if kind in ("header byte", "header bytes"):
        for _ in range(1 if kind == "header byte" else rng.randint(2, 32)):
            out[rng.randrange(0, header_end)] = rng.randrange(256)
    elif kind == "data bytes":
        for _ in range(rng.randint(1, 64)):
            out[rng.randrange(header_end, len(out))] ^= 1 << rng.randrange(8)
    elif kind == "k-quant bytes":
        mutate_k_quant(g, out, header_end, rng)
    elif kind == "truncate":
        del out[rng.randrange(0, len(out)) :]
    elif kind == "insert byte":
        out.insert(rng.randrange(0, header_end), rng.randrange(256))
    elif kind == "delete byte":
        del out[rng.randrange(0, header_end)]
    elif kind == "length field":  # a key's length, a string value's, or an array's count
        i = rng.randrange(len(g.metadata))
        key, value_kind, _ = g.metadata[i]
        at = entry_offsets(g)[i]
        at = rng.choice([at, at + 8 + len(key) + 4 + (4 if value_kind == 9 else 0)])
        poke(out, at, "<Q", rng.choice([*BIG, rng.randrange(1, 1 << 20)]))
    elif kind == "sparse extension":
        extend = rng.choice([1, 4096, 1 << 20])  # (a whole file is hashed on import)
    else:
        mutate_structure(g, kind, rng)
        out = bytearray(g.to_bytes())
    return kind, bytes(out), extend


def run(trials: int, seed: int, workdir: Path) -> dict:
    valid = base_file(workdir / "valid.gguf")
    rng = random.Random(seed)
    path = workdir / "fuzzed.gguf"
    models = workdir / "models"
    outcomes: collections.Counter = collections.Counter()
    failures = []
    for trial in range(trials):
        kind, data, extend = mutate(valid, rng)
        print(f"trial {trial}: {kind}", file=sys.stderr, flush=True)
        path.write_bytes(data)
        if extend:
            with path.open("r+b") as f:
                f.truncate(len(data) + extend)
        try:
            import_gguf(path, models, "fuzzed")
            outcomes[f"{kind}: imported"] += 1
        except GGUFImportError as exc:
            outcomes[f"{kind}: refused"] += 1
            if not str(exc):
                failures.append([trial, kind, "an empty message"])
        except Exception as exc:  # what this fuzz exists to find
            failures.append([trial, kind, repr(exc)[:300]])
        shutil.rmtree(models, ignore_errors=True)
        left = [p for p in workdir.iterdir() if p.name not in ("valid.gguf", "fuzzed.gguf")]
        if left:
            failures.append([trial, kind, f"left behind: {left}"])
    return {"trials": trials, "seed": seed, "outcomes": dict(outcomes), "failures": failures}


if __name__ == "__main__":
    trials, seed, workdir = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    print(json.dumps(run(trials, seed, workdir)))
