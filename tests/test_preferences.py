"""One `Preferences`: saved in a real database, validated in one place, and
honoured by `reprise chat` (a real subprocess) unless a flag overrides it."""

from __future__ import annotations

import json
import sqlite3

import pytest
from test_cli import reprise

from app.cli import build_parser
from app.engine.kvscheme import PREFERENCE_BITS
from app.service.preferences import KV_CHOICES, InvalidPreference, Preferences
from sessions import paths
from sessions.db import open_db
from sessions.settings import Settings


def test_preferences_round_trip_through_the_database():
    chosen = Preferences(temperature=0.2, kv_bits=4, kv_group_size=32, max_context=4096)
    chosen.save(Settings(open_db()))
    assert Preferences.load(Settings(open_db())) == chosen


def test_nothing_saved_reads_as_the_defaults():
    assert Preferences.load(Settings(open_db())) == Preferences()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"temperature": -1.0}, "temperature must be a number from 0 to 5"),
        ({"temperature": float("nan")}, "temperature must be"),
        ({"kv_bits": 5}, "kv bits must be one of None, 8, 4"),
        ({"kv_group_size": 48}, "kv group size must be one of 32, 64, 128"),
        ({"max_tokens": 0}, "max tokens must be a whole number"),
        ({"max_context": 3}, "max context must be a whole number of at least 16"),
        ({"cache_chunk_tokens": True}, "cache chunk tokens"),
    ],
)
def test_a_value_outside_the_rules_is_refused_with_its_rule(change, message):
    with pytest.raises(InvalidPreference, match=message):
        Preferences(**change)


def test_a_damaged_saved_value_gives_way_to_its_default(caplog):
    db = open_db()
    Preferences(temperature=0.3, top_p=0.5).save(Settings(db))
    with db.conn:  # as an older version, or a damaged row, could leave them
        db.execute("update settings set value = '\"warm\"' where key = 'temperature'")
        db.execute("update settings set value = 'not json' where key = 'top_p'")
        db.execute("update settings set value = '5' where key = 'kv_bits'")
    prefs = Preferences.load(Settings(db))
    assert (prefs.temperature, prefs.top_p, prefs.kv_bits) == (0.7, 0.95, None)
    assert "ignoring the saved temperature 'warm'" in caplog.text


def test_the_old_default_penalty_saved_by_every_save_gives_way_to_the_new_default():
    """Every save wrote each preference, the penalty's old default (1.0) too: a user who
    never touched it would keep the looping replies the new default (1.1) is for."""
    db = open_db()
    Preferences(temperature=0.5, repetition_penalty=1.0).save(Settings(db))  # as before
    db.execute("delete from _sqlite_migrations where name = 'm007_repetition_penalty_default'")
    db.conn.commit()
    upgraded = Preferences.load(Settings(open_db()))
    assert (upgraded.temperature, upgraded.repetition_penalty) == (0.5, 1.1)
    Preferences(repetition_penalty=1.3).save(Settings(open_db()))  # a choice: it stays
    assert Preferences.load(Settings(open_db())).repetition_penalty == 1.3


def test_flags_override_only_what_they_give():
    saved = Preferences(temperature=0.2, kv_bits=4, max_tokens=99)
    prefs = saved.with_overrides(temperature=0, kv_bits=None, max_tokens=None)
    assert (prefs.temperature, prefs.kv_bits, prefs.max_tokens) == (0.0, 4, 99)
    assert isinstance(prefs.temperature, float)


def test_the_terminal_offers_the_kv_choices_the_window_does():
    chat = build_parser()._subparsers._group_actions[0].choices["chat"]
    flag = next(a for a in chat._actions if "--kv-bits" in a.option_strings)
    assert tuple(flag.choices) == PREFERENCE_BITS
    assert (None, *PREFERENCE_BITS) == KV_CHOICES


def chat_json(*args: str) -> dict:
    done = reprise("chat", "--json", *args, "hello")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_reprise_chat_honours_the_saved_preferences(tiny_model_dir):
    """The window saved 4-bit and a short greedy reply: the terminal uses them."""
    Preferences(
        model=str(tiny_model_dir), temperature=0.0, max_tokens=5, kv_bits=4, kv_group_size=32
    ).save(Settings(open_db()))
    record = chat_json("--conversation", "new")
    assert record["kv_format"].startswith("4-bit (group 32")
    assert record["generated_tokens"] == 5 and record["model"] == "tiny-random-llama"
    # A flag overrides its preference, and only it.
    record = chat_json("--no-kv-quantization", "--max-tokens", "3")
    assert record["kv_format"] == "16-bit" and record["generated_tokens"] == 3  # float16 on a CPU
    record = chat_json("--kv-bits", "8")
    assert record["kv_format"].startswith("8-bit (group 32")


def test_a_saved_4_bit_cache_is_used_by_the_terminal(tiny_model_dir):
    """Saved with 4-bit in one run, reopened by the next: restored from disk."""
    (paths.models_dir() / tiny_model_dir.name).symlink_to(tiny_model_dir)  # in the library
    Preferences(
        model=tiny_model_dir.name, temperature=0.0, max_tokens=4, kv_bits=4, kv_group_size=32
    ).save(Settings(open_db()))
    first = chat_json("--conversation", "new")
    again = chat_json("--conversation", str(first["conversation_id"]))
    assert again["restore_source"] == "disk", again["cache_rejected"]


def test_the_window_connection_refuses_writes():
    db = open_db(read_only=True)
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        Settings(db).write({"temperature": 0.1})
