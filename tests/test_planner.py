"""The reopen planner: restore the saved cache or recompute the history, whichever
it expects to be faster on this machine, from what it measured here."""

from __future__ import annotations

import pytest
from test_cache_files import new_engine, turn

from app.engine.planner import (
    READ_BANDWIDTH,
    nearest_rate,
    prefill_size_class,
    recompute_is_faster,
)
from sessions.db import open_db


@pytest.fixture
def saved(tiny_model):
    """A conversation of three turns, saved; (its id, its cache's index entry). What
    its turns measured is forgotten: each test says what this machine measured."""
    engine = new_engine(tiny_model)
    conversation = engine.store.create(tiny_model.name)
    for text in ("hello there", "tell me more", "and then what happened"):
        turn(engine, conversation.id, text)
    open_db()["measurements"].delete_where()
    return conversation.id, engine.index.conversation(conversation.id)


def test_the_planner_recomputes_when_that_is_faster(tiny_model, saved):
    conversation_id, _ = saved
    engine = new_engine(tiny_model)
    engine.planner.measurements.observe(READ_BANDWIDTH, 1.0)  # a very slow disk
    far = engine.planner.prefill_key(1 << 20)  # a size far from this chat's: the only one known
    engine.planner.measurements.observe(far, 1e6)
    finished, _ = turn(engine, conversation_id, "quick")
    info = finished.restore
    assert info.source == "recompute"
    assert info.estimate_recompute_s < info.estimate_restore_s
    assert "faster" in info.rejected
    # The recompute taught the planner the rate of a prefill of its own size.
    own = engine.planner.prefill_key(finished.stats.prefilled_tokens)
    assert own != far
    learned = engine.planner.measurements.get(own)
    assert learned is not None and learned > 0


def test_a_long_history_is_judged_by_long_prefills_not_by_short_turns(tiny_model, saved):
    """Short turns prefill slowly per token on a GPU; a long history much faster. The
    estimate for recomputing a history uses the rate measured nearest its length."""
    _, entry = saved
    engine = new_engine(tiny_model)
    usable = len(entry.tokens) - 1
    engine.planner.measurements.observe(
        READ_BANDWIDTH, engine.kvstore.bytes_to_read(entry, usable) / 0.5
    )
    engine.planner.measurements.observe(
        engine.planner.prefill_key(8), usable / 5.0
    )  # short turns: "5 s"
    restore, recompute = engine.planner.estimates(entry, usable, usable)
    assert (restore, recompute) == (pytest.approx(0.5), pytest.approx(5.0))
    assert not recompute_is_faster((restore, recompute))

    engine.planner.measurements.observe(
        engine.planner.prefill_key(usable), usable / 0.05
    )  # its length
    engine.planner.measurements.observe(
        engine.planner.prefill_key(usable << 8), usable / 1e-4
    )  # far longer
    restore, recompute = engine.planner.estimates(entry, usable, usable)
    assert recompute == pytest.approx(0.05)  # neither the short turns' nor the fastest
    assert recompute_is_faster((restore, recompute))


def test_the_nearest_size_is_used_and_a_tie_takes_the_smaller():
    assert prefill_size_class(100) == prefill_size_class(127) == prefill_size_class(64) == 7
    assert prefill_size_class(16_384) == 15
    rates = {7: 1_000.0, 9: 5_000.0, 15: 20_000.0}
    assert nearest_rate(rates, 8) == 1_000.0  # a tie between 7 and 9
    assert nearest_rate(rates, 13) == 20_000.0
    assert nearest_rate(rates, 3) == 1_000.0
    assert nearest_rate({}, 8) is None


def test_estimates_of_another_model_are_not_used(tiny_model, saved):
    _, entry = saved
    engine = new_engine(tiny_model)
    engine.planner.measurements.observe("prefill_tps:another-model:7", 1e9)
    assert engine.planner.estimates(entry, len(entry.tokens) - 1, len(entry.tokens))[1] is None


def test_damaged_estimates_are_not_used(tiny_model, saved):
    """Another program (or a damaged database) can store anything in the measurements:
    the planner ignores what is not a positive rate, and the reopen still works."""
    conversation_id, entry = saved
    engine = new_engine(tiny_model)
    rows = open_db()["measurements"]
    for key, value in [
        (READ_BANDWIDTH, 0),
        (f"{engine.planner.prefill_prefix}7", "fast"),
        (f"{engine.planner.prefill_prefix}8", float("nan")),
        (f"{engine.planner.prefill_prefix}x", 1e6),
        (f"{engine.planner.prefill_prefix}²", 1e6),
    ]:
        rows.upsert({"key": key, "value": value, "updated": "x"}, pk="key")
    assert engine.planner.estimates(entry, len(entry.tokens) - 1, len(entry.tokens)) == (None, None)
    finished, _ = turn(engine, conversation_id, "still works")
    assert finished.restore.source == "disk"
