"""Fuzzed checkpoint layouts: the JSON in a checkpoint file's metadata says which state
item of which layer each tensor is, and which layers token chunks hold. It is read from
a file, so it is untrusted: a real checkpoint of the gemma3-style family model has its
layout mutated hundreds of ways (values replaced by other types or classes, entries
dropped, duplicated, swapped), is written back with a valid checksum (so that only the
layout is wrong), and restored. Every outcome is a refusal with a reason, or a cache
the model can run one more token through; never another exception.

REPRISE_FUZZ_TRIALS sets the number of trials (default 150); REPRISE_FUZZ_SEED the seed.
"""

from __future__ import annotations

import collections
import copy
import json
import os
import random

import mlx.core as mx
import pytest
from test_checkpoint_chunks import started, words_model  # noqa: F401  (a fixture)
from test_window_rows import chat, wide_model  # noqa: F401  (a fixture)

from app.engine.conversation import ConversationEngine
from sessions.cachefiles import CacheIndex, path_from_url, read_file, write_file
from sessions.db import open_db

TRIALS = int(os.environ.get("REPRISE_FUZZ_TRIALS", "150"))
SEED = int(os.environ.get("REPRISE_FUZZ_SEED", "0"))

VALUES = [
    None, 0, 1, -1, 2**31, 1.5, "", "x", True, [], {},
    "KVCache", "RotatingKVCache", "ArraysCache", "CacheList", "MixedKVCache", "QuantizedKVCache",
    ["array", "0.0"], ["value", 3], ["arrays", [None]], {"class": "KVCache", "in_chunks": True},
]  # fmt: skip


def _places(node, out: list) -> list:
    """Every (container, key) in the JSON tree, depth first."""
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for key, child in items:
        out.append((node, key))
        if isinstance(child, dict | list):
            _places(child, out)
    return out


def mutate(layout: list, rng: random.Random) -> str:
    """Change `layout` in place; the kind of change."""
    container, key = rng.choice(_places(layout, []))
    kind = rng.choice(["replace", "replace", "drop", "duplicate", "swap"])
    if kind == "replace":
        container[key] = copy.deepcopy(rng.choice(VALUES))
    elif kind == "drop":
        del container[key]
    elif kind == "duplicate" and isinstance(container, list):
        container.insert(key, copy.deepcopy(container[key]))
    elif kind == "swap" and isinstance(container, list) and len(container) > 1:
        other = rng.randrange(len(container))
        container[key], container[other] = container[other], container[key]
    else:
        container[key] = copy.deepcopy(rng.choice(VALUES))
        kind = "replace"
    return kind


def last_checkpoint(conversation_id: int) -> tuple:
    """A conversation's last checkpoint: (conversation id, path, bytes, layout)."""
    index = CacheIndex(open_db())
    key = index.conversation(conversation_id).checkpoint_keys[-1]
    path = path_from_url(index.chunk(key)["url"])
    _, metadata = read_file(path, {})
    return conversation_id, path, path.read_bytes(), json.loads(metadata["layout"])


@pytest.fixture
def checkpoint(words_model):  # noqa: F811
    """A two-turn conversation's last checkpoint, its windows whole (its turns are
    longer than them)."""
    _, conversation_id = started(words_model, 2)
    return last_checkpoint(conversation_id)


@pytest.fixture
def chained_checkpoint(wide_model):  # noqa: F811
    """An eight-turn conversation's last checkpoint, whose windows hold only the rows
    since the one before it (app/engine/window_rows.py)."""
    _, conversation_id, _ = chat(wide_model, 8)
    return last_checkpoint(conversation_id)


def _files_and_rows(index: CacheIndex, keys: list[str]) -> dict[str, tuple[dict, bytes]]:
    return {key: (index.chunk(key), index.chunk_path(key).read_bytes()) for key in keys}


def _put_back(index: CacheIndex, kept: dict[str, tuple[dict, bytes]]) -> None:
    """The checkpoints' files and index rows as they were, where a restore dropped them
    (`checkpoints.restore` drops files that do not fit together), so that every trial
    restores the mutated checkpoint, not the one before it."""
    for key, (row, data) in kept.items():
        if index.chunk(key) is None:
            index.chunk_path(key).write_bytes(data)
            index.db["cache_chunks"].upsert(row, pk="key")


def fuzz(model, checkpoint: tuple) -> collections.Counter:
    """TRIALS mutations of the checkpoint's layout, each restored; their outcomes."""
    conversation_id, path, original, layout = checkpoint
    tensors, metadata = read_file(path, {})
    metadata = {k: v for k, v in metadata.items() if k != "checksum"}
    engine = ConversationEngine(open_db(), model)
    entry = engine.index.conversation(conversation_id)
    kept = _files_and_rows(engine.index, entry.checkpoint_keys)
    rng = random.Random(SEED)
    outcomes: collections.Counter = collections.Counter()
    try:
        for _ in range(TRIALS):
            _put_back(engine.index, kept)  # a refusal drops the files it read
            mutated = copy.deepcopy(layout)
            kind = mutate(mutated, rng)
            write_file(path, tensors, {**metadata, "layout": json.dumps(mutated)})
            result = engine.kvstore.restore(entry, len(entry.tokens))
            if result.cache is None:
                assert result.rejected, kind
                outcomes["refused"] += 1
                continue
            logits = model.model(mx.array([[5]]), cache=result.cache)
            mx.eval(logits)
            outcomes["restored and ran"] += 1
    finally:
        path.write_bytes(original)
    return outcomes


def test_a_mutated_checkpoint_layout_is_refused_or_runs(words_model, checkpoint, capsys):  # noqa: F811
    outcomes = fuzz(words_model, checkpoint)
    with capsys.disabled():
        print(f"\ncheckpoint layout fuzz, {TRIALS} trials (seed {SEED}): {dict(outcomes)}")
    assert outcomes["refused"] > 0


def test_a_mutated_chained_checkpoint_layout_is_refused_or_runs(
    wide_model,  # noqa: F811
    chained_checkpoint,
    capsys,
):
    """The same for a checkpoint whose windows' rows go back into the ones before it."""
    assert any(
        "rows" in spec and spec["rows"][0] > spec["rows"][1] - spec["rows"][2]
        for spec in chained_checkpoint[3]
    )
    outcomes = fuzz(wide_model, chained_checkpoint)
    with capsys.disabled():
        print(f"\nchained checkpoint layout fuzz, {TRIALS} trials (seed {SEED}): {dict(outcomes)}")
    assert outcomes["refused"] > 0 and outcomes["restored and ran"] > 0


def _first_value_item(layout: list) -> list:
    """The first ["value", n] item of the first layer that has one."""
    return next(item for spec in layout for item in spec.get("items", []) if item[0] == "value")


def _a_sixteen_bit_bulk_named_twice(layout: list) -> None:
    """A 16-bit window layer's stored tokens listed as two arrays (a name duplicated):
    it took them, and failed at the next token (seed 10, 1,000 trials)."""
    spec = next(spec for spec in layout if spec.get("class") == "MixedKVCache" and "items" in spec)
    kind, names = spec["items"][1]
    assert kind == "arrays" and len(names) == 1  # the 16 bits of the CPU path: one array
    names.append(names[0])


FOUND = {  # what the fuzz found: each escaped the restore as another exception
    "a class name that is not a string": lambda layout: layout[0].update({"class": {}}),
    "a count that is an array": lambda layout: _first_value_item(layout).__setitem__(
        slice(None), ["array", layout[0]["items"][0][1]]
    ),
    "a count past 32 bits": lambda layout: _first_value_item(layout).__setitem__(1, 2**31),
    "a 16-bit bulk named twice": _a_sixteen_bit_bulk_named_twice,
}


@pytest.mark.parametrize("change", FOUND.values(), ids=FOUND.keys())
def test_what_the_fuzz_found_is_refused(words_model, checkpoint, change):  # noqa: F811
    conversation_id, path, _, layout = checkpoint
    tensors, metadata = read_file(path, {})
    change(layout)
    metadata = {k: v for k, v in metadata.items() if k != "checksum"}
    write_file(path, tensors, {**metadata, "layout": json.dumps(layout)})
    engine = ConversationEngine(open_db(), words_model)
    entry = engine.index.conversation(conversation_id)
    result = engine.kvstore.restore(entry, len(entry.tokens))
    assert result.cache is None and result.rejected
