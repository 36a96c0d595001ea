"""A chat's own settings (sampling, KV preference, model): stored with the chat in
SQLite, applied to every kind of turn by the one rule, and kept by the terminal's
flags; on a real database, real cache files and the tiny model."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import replace

import pytest
from test_cli import reprise
from test_service import new_conversation, reply, service  # noqa: F401

from app.engine.chat import ChatSession
from app.engine.generation import SamplingSettings
from app.service.chat import ChatService
from app.service.preferences import InvalidPreference, Preferences
from sessions import paths
from sessions.db import open_db
from sessions.overrides import KV_OFF, ChatOverrides


def test_a_chat_keeps_its_own_settings_and_the_rest_follow_the_defaults(service):  # noqa: F811
    own, other = new_conversation(service), new_conversation(service)
    service.set_chat_settings(own, ChatOverrides(max_tokens=2, temperature=0.3, kv_bits=8))
    assert ChatService(open_db()).store.get(own).overrides == ChatOverrides(
        max_tokens=2, temperature=0.3, kv_bits=8
    )
    mine = service.chat_preferences(own)
    assert (mine.max_tokens, mine.temperature, mine.kv_bits) == (2, 0.3, 8)
    assert mine.top_p == service.preferences().top_p  # not set: the default
    assert service.chat_preferences(other) == service.preferences()

    finished, _ = reply(service, own, "Tell me a long story please")
    assert finished.stats.generated_tokens <= 2 and finished.stats.kv_format.startswith("8-bit")
    finished, _ = reply(service, other, "Tell me a long story please")
    assert finished.stats.generated_tokens == 6  # the default's limit (the tiny model never stops)
    exported = json.loads(service.store.export(own, "json"))
    assert exported["settings"] == {"temperature": 0.3, "max_tokens": 2, "kv_bits": 8}
    # A change of the defaults reaches every field the chat does not set.
    service.save_preferences(replace(service.preferences(), top_p=0.5))
    assert service.chat_preferences(own).top_p == 0.5


def test_every_kind_of_turn_runs_with_the_chats_settings(service):  # noqa: F811
    chat = new_conversation(service)
    reply(service, chat, "hello")
    service.set_chat_settings(chat, ChatOverrides(max_tokens=3))
    turns = {
        "regenerate": lambda: service.regenerate(chat),
        "edit": lambda: service.edit(service.store.get(chat).messages[-2].id, "hi again"),
        "continue": lambda: service.continue_reply(service.store.get(chat).messages[-1].id),
    }
    for name, turn in turns.items():
        finished = list(turn())[-2]
        assert finished.stats.generated_tokens <= 3, name


def test_use_defaults_clears_them_and_a_bad_value_is_refused(service):  # noqa: F811
    chat = new_conversation(service)
    service.set_chat_settings(chat, ChatOverrides(temperature=0.2, kv_bits=KV_OFF))
    assert service.chat_preferences(chat).kv_bits is None  # "Off", not "the default"
    service.save_preferences(replace(service.preferences(), kv_bits=4))
    assert service.chat_preferences(chat).kv_bits is None
    with pytest.raises(InvalidPreference, match="temperature"):
        service.set_chat_settings(chat, ChatOverrides(temperature=9.0))
    assert service.store.get(chat).overrides.temperature == 0.2  # nothing changed
    service.set_chat_settings(chat, ChatOverrides())
    assert service.store.get(chat).overrides == ChatOverrides()
    assert service.chat_preferences(chat).kv_bits == 4


def test_a_damaged_stored_setting_reads_as_the_default(service):  # noqa: F811
    chat = new_conversation(service)
    raw = sqlite3.connect(paths.data_dir() / "reprise.db")
    with raw:
        raw.execute("update conversations set temperature = 'hot', max_tokens = 99999999")
    overrides = service.store.get(chat).overrides
    assert overrides.temperature is None  # text where a number belongs
    prefs = service.chat_preferences(chat)  # out of range: left out, with a line in the log
    assert prefs.max_tokens == service.preferences().max_tokens
    reply(service, chat, "still answers")


def test_changing_a_chats_kv_setting_keeps_its_saved_cache_usable(service):  # noqa: F811
    """The saved cache's format is part of its key: after a change the reopened chat
    recomputes (nothing wrong is read), saves the new format, and later reopens from disk."""
    chat = new_conversation(service)
    service.set_chat_settings(chat, ChatOverrides(kv_bits=8))
    reply(service, chat, "The first message of a chat long enough for a chunk or two")
    assert service.index.conversation(chat).kv_format.startswith("k8v8")

    service.set_chat_settings(chat, ChatOverrides(kv_bits=KV_OFF))
    reopened = ChatService(open_db())  # as after a restart
    finished, saved = reply(reopened, chat, "and the second")
    assert finished.restore.source == "recompute" and "8" in finished.restore.rejected
    assert saved.error is None
    assert not reopened.index.conversation(chat).kv_format.startswith("k8")
    assert reopened.index.verify() == []
    messages = reopened.store.get(chat).chat_messages()
    session = ChatSession(reopened.engine.loaded)
    *_, fresh = session.reply(messages[:-1], sampling=SamplingSettings.greedy(6))
    assert finished.text == fresh.text  # the same reply as with no cache at all

    service.set_chat_settings(chat, ChatOverrides(kv_bits=4))
    again = ChatService(open_db())
    assert again.prefetch(chat).source == "disk"  # a full-precision cache serves 4-bit
    finished, _ = reply(again, chat, "and the third")
    assert finished.restore.source == "memory"
    assert finished.stats.kv_format.startswith("4-bit")


def test_a_chat_continued_with_another_model_becomes_that_models_chat(service):  # noqa: F811
    chat = service.create_conversation("an-older-model").id
    reply(service, chat, "hello")
    assert service.store.get(chat).model == service.engine.loaded.name


def test_the_terminal_stores_its_flags_as_the_chats_settings(tiny_model_dir):
    (paths.models_dir() / "tiny").symlink_to(tiny_model_dir)
    ChatService(open_db()).save_preferences(Preferences(model="tiny", kv_group_size=32))
    flags = ["--temp", "0", "--max-tokens", "3", "--kv-bits", "8"]
    done = reprise("chat", "--conversation", "new", *flags, "--json", "hi")
    assert done.returncode == 0, done.stderr
    first = json.loads(done.stdout)
    chat = str(first["conversation_id"])
    assert first["generated_tokens"] <= 3
    # Later, without those flags, the chat keeps them; a new flag adds to them.
    done = reprise("chat", "--conversation", chat, "--no-kv-quantization", "--json", "again")
    assert done.returncode == 0, done.stderr
    second = json.loads(done.stdout)
    assert second["generated_tokens"] <= 3
    stored = ChatService(open_db()).store.get(int(chat)).overrides
    assert stored == ChatOverrides(temperature=0.0, max_tokens=3, kv_bits=KV_OFF)

    done = reprise("chat", "--conversation", chat, "--top-p", "7", "again")
    assert done.returncode != 0 and "top p must be" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_terminal_says_when_a_chats_model_is_gone(tiny_model_dir):
    (paths.models_dir() / "tiny").symlink_to(tiny_model_dir)
    chat = ChatService(open_db()).create_conversation("a-deleted-model").id
    done = reprise("chat", "--conversation", str(chat), "hi")
    assert done.returncode != 0
    assert "made with a-deleted-model, which is no longer installed" in done.stderr
    assert "--model" in done.stderr and "Traceback" not in done.stderr
