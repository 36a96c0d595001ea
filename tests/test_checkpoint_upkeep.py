"""What becomes of a chat's checkpoint files when they are evicted, refused, shared,
or saved under another KV preference (issue 14): what stays still restores, and no
chat loses files another one can use.
"""

from __future__ import annotations

import os
import resource
from dataclasses import replace

import numpy as np
import pytest
from families import Family, build
from tampering import rewrite_chunk, rewrite_layout
from test_checkpoint_chunks import OPTIONS, turn
from test_window_rows import MESSAGES, WINDOW, chat, wide_model, windows_of  # noqa: F401

from app.engine.conversation import ConversationEngine, ReplyFinished, TurnOptions
from app.engine.generation import KVSettings
from sessions.db import open_db


def test_eviction_takes_a_chains_checkpoints_from_its_end(wide_model):  # noqa: F811
    """A save stamps a conversation's chunks and checkpoints together; eviction takes
    the last turns' first, so the chat reopens from the checkpoint before them (one
    taken from the middle of a chain would leave the later ones unusable)."""
    engine, conversation_id, _ = chat(wide_model, 8)
    index = engine.index
    entry = index.conversation(conversation_id)
    rows = {key: index.chunk(key) for key in entry.all_keys}
    last_two = [index.chunk(key)["token_end"] for key in entry.checkpoint_keys[-2:]]
    over = sum(row["bytes"] for row in rows.values() if row["token_end"] in last_two)
    index.evict_to_budget(sum(row["bytes"] for row in rows.values()) - over)

    left = {key for key in rows if index.chunk(key) is not None}
    assert {rows[key]["token_end"] for key in rows.keys() - left} == set(last_two)
    finished, _ = turn(ConversationEngine(open_db(), wide_model), conversation_id, "so")
    assert (finished.restore.source, finished.restore.rejected) == ("disk", None)
    assert finished.restore.checkpoint == len(entry.checkpoint_keys) - 2
    assert finished.stats.reused_tokens == rows[entry.checkpoint_keys[-3]]["token_end"]


def test_eviction_takes_a_checkpoint_before_the_chunks_it_needs(wide_model):  # noqa: F811
    """A chunk and a checkpoint that end together: the checkpoint goes first (without the
    chunk it could not be used, and would stay on disk for nothing); the chunk is
    then needed by no checkpoint left, and goes next."""
    engine, conversation_id, _ = chat(wide_model, 3)
    index = engine.index
    entry = index.conversation(conversation_id)
    last_chunk, last_checkpoint = entry.chunk_keys[-1], entry.checkpoint_keys[-1]
    assert index.chunk(last_chunk)["token_end"] == index.chunk(last_checkpoint)["token_end"]

    index.evict_to_budget(index.usage()[1] - 1)
    assert [key for key in entry.all_keys if index.chunk(key) is None] == [last_checkpoint]
    index.evict_to_budget(index.usage()[1] - 1)
    gone = [key for key in entry.all_keys if index.chunk(key) is None]
    assert sorted(gone) == sorted([last_chunk, last_checkpoint])


def test_checkpoints_whose_rows_do_not_fit_are_dropped_and_the_ones_before_serve(wide_model):  # noqa: F811
    """Files that each pass their checks but do not fit together (here an earlier
    checkpoint's layout, signed again, says other rows): the restore is refused and
    drops the files it read, so nothing is built on them; the checkpoint before them
    serves the next restore."""
    engine, conversation_id, _ = chat(wide_model, 6)
    index = engine.index
    entry = index.conversation(conversation_id)

    def other_rows(layout: list) -> None:
        window = next(layer for layer in layout if "rows" in layer)
        window["rows"][0] += 1

    rewrite_layout(index, entry.checkpoint_keys[-2], other_rows)
    refused = engine.kvstore.restore(entry, len(entry.tokens))
    assert refused.cache is None and "rows" in refused.rejected
    assert [index.chunk(key) is None for key in entry.checkpoint_keys[-3:]] == [False, True, True]
    restored = engine.kvstore.restore(entry, len(entry.tokens))
    assert restored.rejected is None
    assert (restored.checkpoint, len(restored.tokens)) == (
        len(entry.checkpoint_keys) - 2,
        index.chunk(entry.checkpoint_keys[-3])["token_end"],
    )


# RecurrentGemma's layout: a recurrent layer and local windows, no global attention, so
# no layer is chunked and each checkpoint holds every window (whole, or rows since).
WINDOWS_ONLY = Family(
    "recurrent-gemma",
    "recurrent_gemma",
    {
        "attention_bias": False,
        "conv1d_width": 4,
        "intermediate_size": 128,
        "logits_soft_cap": 30.0,
        "num_attention_heads": 2,
        "num_hidden_layers": 3,
        "num_key_value_heads": 1,
        "rms_norm_eps": 1e-6,
        "attention_window_size": WINDOW,
        "block_types": ["recurrent", "attention", "attention"],
    },
    ("ArraysCache", "RotatingKVCache", "RotatingKVCache"),
    False,
)


@pytest.fixture(scope="module")
def windows_only_model(starter_model_dir, tmp_path_factory):
    from app.engine.loading import load

    return load(build(WINDOWS_ONLY, starter_model_dir, tmp_path_factory.mktemp("windows")))


@pytest.mark.parametrize("before,after", [(16, 8), (8, 16), (8, 4)])
def test_a_changed_kv_preference_starts_a_windows_only_chats_checkpoints_afresh(
    windows_only_model, before, after
):
    """With no chunked layer, a checkpoint's key and its chat's entry name its windows'
    format: after the KV preference changes, a save builds on no checkpoint of the
    other format, and the chat reopens from its own files (it used to take rows from
    checkpoints of the other format, and refuse every restore until the window had
    moved past them)."""

    def options(bits: int) -> TurnOptions:
        kv = KVSettings() if bits == 16 else KVSettings(bits=bits, group_size=32)
        return replace(OPTIONS, kv=kv)

    engine = ConversationEngine(open_db(), windows_only_model)
    conversation_id = engine.store.create(windows_only_model.name).id
    for text in MESSAGES[:3]:
        list(engine.send(conversation_id, text, options(before)))
    formats = {engine.index.conversation(conversation_id).kv_format}
    for text in MESSAGES[3:5]:
        list(engine.send(conversation_id, text, options(after)))
    formats.add(engine.index.conversation(conversation_id).kv_format)
    assert len(formats) == 2 and all(f.startswith("k") or "float" in f for f in formats)

    for text in MESSAGES[5:7]:
        reopened = ConversationEngine(open_db(), windows_only_model)
        events = list(reopened.send(conversation_id, text, options(after)))
        finished = next(e for e in events if isinstance(e, ReplyFinished))
        assert (finished.restore.source, finished.restore.rejected) == ("disk", None)


def test_a_refused_chain_keeps_the_checkpoints_another_chat_lists(wide_model):  # noqa: F811
    """Two chats that begin alike share their first checkpoint. When one chat's chain is
    refused (its own last file, signed again, holds its rows as another type), it drops
    its own files, not the shared one: the other chat restores as before."""
    engine = ConversationEngine(open_db(), wide_model)
    kept, refused = (engine.store.create(wide_model.name).id for _ in range(2))
    for text in MESSAGES[:3]:
        turn(engine, kept, text)
    for text in (MESSAGES[0], "something else entirely"):
        turn(engine, refused, text)
    index = engine.index
    ours, theirs = index.conversation(kept), index.conversation(refused)
    shared = set(ours.checkpoint_keys) & set(theirs.checkpoint_keys)
    assert shared
    before = engine.kvstore.restore(ours, len(ours.tokens))

    def rows_as_another_type(tensors: dict, _metadata: dict) -> None:
        for name, array in list(tensors.items()):
            if array.dtype == np.float16:
                tensors[name] = array.view(np.uint16)

    rewrite_chunk(index, theirs.checkpoint_keys[-1], rows_as_another_type)
    assert engine.kvstore.restore(theirs, len(theirs.tokens)).rejected
    assert index.chunk(theirs.checkpoint_keys[-1]) is None  # its own: dropped
    assert all(index.chunk(key) for key in shared)
    after = engine.kvstore.restore(ours, len(ours.tokens))
    assert (after.rejected, after.checkpoint) == (None, before.checkpoint)


def test_files_the_system_cannot_open_just_now_are_kept(wide_model):  # noqa: F811
    """Out of file descriptors (EMFILE) mid-restore: the restore is refused, and the
    checkpoints it could not open are kept, not taken for damaged; with descriptors to
    spare again the chat restores from them."""
    engine, conversation_id, _ = chat(wide_model, 6)
    entry = engine.index.conversation(conversation_id)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest_free = os.dup(0)  # a new descriptor takes the lowest free number
    os.close(lowest_free)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))  # none to spare
    try:
        refused = engine.kvstore.restore(entry, len(entry.tokens))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert refused.cache is None and "unreadable file" in refused.rejected
    assert all(engine.index.chunk(key) for key in entry.all_keys)
    restored = engine.kvstore.restore(entry, len(entry.tokens))
    assert (restored.rejected, restored.checkpoint) == (None, len(entry.checkpoint_keys))
