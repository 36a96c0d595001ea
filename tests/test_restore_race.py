"""A saved cache read beside recomputing it, the first in taken (app/engine/restore_race.py).

Racing is on by default only where the GPU has memory of its own; these tests turn it
on for the CPU path (`races.enabled`), on the starter model: its prefill steps are slow
enough here that the order of the two is set by the test, not by the machine's load.
"""

from __future__ import annotations

import gc
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from app.bench.reopen import build_history
from app.engine.chat import ChatSession
from app.engine.conversation import ConversationEngine, ReplyFinished, TurnOptions
from app.engine.generation import KVSettings, SamplingSettings
from app.engine.planner import COPY_BANDWIDTH, prefill_size_class
from app.engine.restore_race import restore_is_sooner
from app.engine.turns import RestoreInfo
from sessions.cachefiles import path_from_url
from sessions.db import open_db
from sessions.measurements import Measurements

OPTIONS = TurnOptions(sampling=SamplingSettings.greedy(5))
HISTORY = 700  # two prefill steps of 512 tokens: the restore can be taken after the first


def test_the_restore_is_taken_when_it_ends_before_the_prefill_would():
    # 600 of 1,600 tokens in 1 s: the rest would take 1.67 s more. The files are copied
    # as they are read, from now on: the restore ends with the later of the two, and
    # must be expected sooner by a margin (a read's rate is not steady).
    assert restore_is_sooner(10.0, 9.0, 600, 1600, read_end=11.2, copy_s=0.5)
    assert restore_is_sooner(10.0, 9.0, 600, 1600, read_end=10.2, copy_s=1.4)
    assert not restore_is_sooner(10.0, 9.0, 600, 1600, read_end=10.2, copy_s=1.5)
    assert not restore_is_sooner(10.0, 9.0, 600, 1600, read_end=11.5, copy_s=0.0)
    # A read that has not read a file yet says nothing of when it ends.
    assert not restore_is_sooner(10.0, 9.0, 600, 1600, read_end=None, copy_s=0.0)


def save_chat(loaded, builder_db: Path, options: TurnOptions = OPTIONS) -> int:
    """A chat of about `HISTORY` tokens, saved, by an engine whose prefill rates are kept
    apart (in `builder_db`): the engines the tests make have measured no prefill of its
    size."""
    builder = ConversationEngine(open_db(), loaded)
    builder.planner.measurements = Measurements(open_db(builder_db))
    conversation = builder.store.create(loaded.name)
    build_history(builder, conversation.id, HISTORY)
    list(builder.send(conversation.id, "Summarise this.", options))
    return conversation.id


# Where the module's saved chat is made, and what each test starts from.
_FOLDERS = ("data", "cache", "models", "log")


def point_at(patch: pytest.MonkeyPatch, root: Path) -> None:
    for name in _FOLDERS:
        patch.setenv(f"REPRISE_{name.upper()}_DIR", str(root / name))


@pytest.fixture(scope="module")
def saved_once(starter_model, tmp_path_factory) -> tuple[Path, int]:
    """The chat of `save_chat`, made once a module (its history's prefill is most of a
    test's set-up), and its folders kept as made."""
    made = tmp_path_factory.mktemp("saved-chat")
    with pytest.MonkeyPatch.context() as patch:
        point_at(patch, made / "live")
        conversation = save_chat(starter_model, made / "builder.db")
    shutil.copytree(made / "live", made / "as-made")
    return made, conversation


@pytest.fixture
def saved_chat(saved_once, monkeypatch) -> int:
    """A fresh copy of the saved chat's folders, at the paths it was made at (the cache
    index holds its files' URLs)."""
    made, conversation = saved_once
    gc.collect()  # the last test's engines let go of the folders' database first
    shutil.rmtree(made / "live")
    shutil.copytree(made / "as-made", made / "live")
    point_at(monkeypatch, made / "live")
    return conversation


def reopened(loaded) -> ConversationEngine:
    """A new engine, as after a restart, racing its restores."""
    engine = ConversationEngine(open_db(), loaded)
    engine.races.enabled = True
    return engine


def turn(
    engine, conversation_id: int, text: str, wait_for_the_read=False, stop=None, options=OPTIONS
):
    """One turn's (first restore event, reply); `wait_for_the_read`: the race's read is
    done before the prefill's first step ends, so the restore is in first."""
    events = engine.send(conversation_id, text, options, should_stop=stop or (lambda: False))
    first = next(events)
    assert isinstance(first, RestoreInfo)
    if wait_for_the_read:
        engine.races.current.read.wait()
    finished = next(e for e in events if isinstance(e, ReplyFinished))
    list(events)  # the save
    return first, finished


def fresh_reply(loaded, engine, conversation_id: int, options=OPTIONS) -> str:
    """The reply computed with no cache, from the prompt the turn had (its saved tokens
    kept as they were)."""
    messages = engine.store.get(conversation_id).chat_messages()[:-1]
    session = ChatSession(loaded)
    prompt = session.render(messages, known=engine.session.tokens)
    *_, finished = session.generate(prompt, sampling=options.sampling, kv=options.kv)
    return finished.text


@pytest.mark.parametrize("bits", [None, 8])
def test_a_restore_in_first_replaces_the_prefill_and_replies_the_same(
    starter_model, tmp_path, bits
):
    options = replace(OPTIONS, kv=KVSettings(bits))
    saved_chat = save_chat(starter_model, tmp_path / "builder.db", options)
    engine = reopened(starter_model)
    started, finished = turn(
        engine, saved_chat, "And in one word?", wait_for_the_read=True, options=options
    )
    assert started.raced and started.source == "recompute"  # what the window hears first
    restore = finished.restore
    assert (restore.source, restore.raced, restore.rejected) == ("disk", True, None)
    assert restore.tokens >= HISTORY - 20 and restore.bytes_read > 0
    assert finished.stats.reused_tokens == restore.tokens  # only the new message prefilled
    assert finished.text == fresh_reply(starter_model, engine, saved_chat, options)
    # The copy's rate is measured for the next race; no prefill rate from a prefill let go.
    assert engine.planner.copy_rate()
    assert not engine.planner.knows_size(restore.tokens)


def test_a_prefill_in_first_lets_the_read_go_and_teaches_the_planner(starter_model, saved_chat):
    engine = reopened(starter_model)
    engine.planner.measurements.observe(COPY_BANDWIDTH, 1.0)  # a copy that would take ages
    _, finished = turn(engine, saved_chat, "And in one word?", wait_for_the_read=True)
    restore = finished.restore
    assert (restore.source, restore.raced, restore.rejected) == ("recompute", True, None)
    assert finished.stats.reused_tokens == 0
    # The size is measured now: the next reopen at it asks the planner, no race.
    assert engine.planner.knows_size(len(engine.session.tokens))
    started, again = turn(reopened(starter_model), saved_chat, "Thanks.")
    assert not started.raced and again.restore.source == "disk"


def test_a_prompt_past_a_size_class_is_learned_as_the_next_reopen_asks(starter_model, saved_chat):
    """A message that takes the prompt past a power of two: the race's prefill teaches
    the prompt's size, and an edit of that message, restoring the same history for a
    prompt as long, asks the planner for that size (not the history's) and does not
    race again."""
    engine = reopened(starter_model)
    history = len(engine.index.conversation(saved_chat).tokens)
    crossing = (1 << history.bit_length()) - history + 20  # tokens, "so" is one each
    engine.planner.measurements.observe(COPY_BANDWIDTH, 1.0)  # the prefill wins
    _, finished = turn(engine, saved_chat, "Why? " + "so " * crossing, wait_for_the_read=True)
    assert finished.restore.source == "recompute" and finished.restore.raced
    assert prefill_size_class(finished.stats.prompt_tokens) > prefill_size_class(history)
    user = engine.store.message(finished.message_id).parent_id
    # A prefill of the history's size measured slow: a recompute of the prompt is not.
    engine.planner.measurements.observe(engine.planner.prefill_key(history), 1.0)
    engine = reopened(starter_model)
    events = engine.edit(user, "How? " + "so " * crossing, OPTIONS)
    started = next(events)
    list(events)
    assert isinstance(started, RestoreInfo) and not started.raced
    assert started.estimate_recompute_s < history / 10  # not at 1 token a second


def test_a_damaged_file_costs_the_race_nothing(starter_model, saved_chat):
    engine = reopened(starter_model)
    key = engine.index.conversation(saved_chat).chunk_keys[1]
    damaged = path_from_url(engine.index.chunk(key)["url"])
    data = bytearray(damaged.read_bytes())
    data[-5] ^= 0xFF  # a byte of the tensors: the checksum finds it
    damaged.write_bytes(bytes(data))
    _, finished = turn(engine, saved_chat, "And in one word?", wait_for_the_read=True)
    restore = finished.restore
    assert restore.source == "recompute" and restore.raced
    assert "checksum" in restore.rejected
    assert finished.text == fresh_reply(starter_model, engine, saved_chat)


def test_stop_during_a_race_stops_it_and_the_chat_goes_on(starter_model, saved_chat):
    engine = reopened(starter_model)
    _, stopped = turn(engine, saved_chat, "And in one word?", stop=lambda: True)
    assert stopped.stats.finish_reason == "cancelled" and stopped.text == ""
    assert engine.races.current is None and not stopped.restore.rejected
    # A stopped prefill teaches no rate (its tokens counted were not all fed): the size
    # is still raced.
    assert not engine.planner.knows_size(stopped.stats.prompt_tokens)
    # The next turn goes on from the steps prefilled before the stop.
    _, finished = turn(engine, saved_chat, "And in one word?")
    assert finished.restore.source == "memory" and finished.stats.reused_tokens > 0
    assert finished.text == fresh_reply(starter_model, engine, saved_chat)


def test_stop_during_a_switch_lets_the_restore_go(starter_model, saved_chat):
    """A slow disk after a wrong guess would hold Stop until the read's end: the restore
    hears it between files."""
    asked = []

    def stop_once_switching() -> bool:  # the first ask comes after the first step
        asked.append(True)
        return len(asked) > 1

    engine = reopened(starter_model)
    _, stopped = turn(
        engine, saved_chat, "And in one word?", wait_for_the_read=True, stop=stop_once_switching
    )
    assert stopped.stats.finish_reason == "cancelled"
    assert (stopped.restore.source, stopped.restore.rejected) == ("recompute", "stopped")
    _, finished = turn(engine, saved_chat, "And in one word?")
    assert finished.text == fresh_reply(starter_model, engine, saved_chat)


def test_races_are_off_where_the_gpu_shares_the_hosts_memory(starter_model):
    """The CPU path (and a Mac's): restoring wins by 100x, nothing to race."""
    engine = ConversationEngine(open_db(), starter_model)
    assert not engine.races.wanted(HISTORY, HISTORY + 20)
    engine.races.enabled = True
    assert engine.races.wanted(HISTORY, HISTORY + 20)


def test_a_cache_with_a_checkpoint_is_not_raced_and_restores_as_before(sliding_model, tmp_path):
    """A sliding window's layers are in a checkpoint, not in chunks: such a cache is
    restored the planner's way (app/engine/checkpoints.py), races on or not."""
    builder = ConversationEngine(open_db(), sliding_model)
    builder.planner.measurements = Measurements(open_db(tmp_path / "builder.db"))
    conversation = builder.store.create(sliding_model.name)
    long = " ".join(["Tell me about the weather in spring and in autumn"] * 12)
    list(builder.send(conversation.id, long, OPTIONS))
    engine = reopened(sliding_model)
    saved = len(engine.index.conversation(conversation.id).tokens)
    assert engine.races.wanted(saved, saved + 20)
    started, finished = turn(engine, conversation.id, "And in winter?")
    assert not started.raced and engine.races.current is None
    assert finished.restore.source == "disk" and finished.restore.checkpoint == 1  # its own
