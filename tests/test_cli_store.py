"""`reprise conversations` and `reprise cache` as a user runs them (real subprocesses)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from mlx_lm.models.cache import load_prompt_cache

REPRISE = str(Path(sys.executable).with_name("reprise"))


def reprise(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [REPRISE, *args], capture_output=True, text=True, timeout=300, check=False
    )


def test_conversations_and_cache_commands(tiny_model_dir, tmp_path):
    made = reprise(
        "chat",
        "--model",
        str(tiny_model_dir),
        "--conversation",
        "new",
        "--temp",
        "0",
        "--max-tokens",
        "6",
        "--json",
        "remember the word pelican",
    )
    assert made.returncode == 0, made.stderr
    conversation = str(json.loads(made.stdout)["conversation_id"])

    listed = json.loads(reprise("conversations", "list", "--json").stdout)
    assert [c["title"] for c in listed] == ["remember the word pelican"]
    shown = reprise("conversations", "show", conversation)
    assert "user:\nremember the word pelican" in shown.stdout
    found = reprise("conversations", "search", "pelican")
    assert found.returncode == 0 and "pelican" in found.stdout
    assert reprise("conversations", "search", "walrus").returncode == 1
    exported = reprise("conversations", "export", conversation, "--format", "json")
    assert json.loads(exported.stdout)["messages"][0]["content"] == "remember the word pelican"

    ls = json.loads(reprise("cache", "ls", "--json").stdout)
    assert ls["conversations"][0]["conversation_id"] == int(conversation)
    assert ls["conversations"][0]["tokens"] > 0 and ls["bytes"] > 0
    assert reprise("cache", "verify").returncode == 0

    out = tmp_path / "prompt-cache.safetensors"
    # cache export finds the model by the name stored with the conversation.
    import shutil

    from sessions import paths

    shutil.copytree(tiny_model_dir, paths.models_dir() / tiny_model_dir.name)
    exported = reprise("cache", "export", conversation, str(out))
    assert exported.returncode == 0, exported.stderr
    cache, metadata = load_prompt_cache(str(out), return_metadata=True)
    assert metadata["model"] == tiny_model_dir.name
    assert cache[0].offset == ls["conversations"][0]["tokens"]

    assert reprise("conversations", "delete", conversation).returncode == 0
    assert json.loads(reprise("conversations", "list", "--json").stdout) == []
    assert json.loads(reprise("cache", "ls", "--json").stdout)["chunks"] == 0


READ_ONLY_COMMANDS = [
    ["conversations", "list"],
    ["conversations", "show", "1"],
    ["conversations", "search", "pelican"],
    ["conversations", "export", "1"],
    ["cache", "ls"],
    ["cache", "verify"],
]
LOADED_AFTER = """import sys
from app.cli import main
code = main(sys.argv[1:])
print(code, sorted(m for m in ("mlx.core", "mlx_lm", "transformers") if m in sys.modules))
"""


def test_what_only_reads_the_store_starts_without_the_model_libraries(tiny_model_dir):
    """Reading what is stored waits for no mlx-lm import (about 0.8 s of a 1.0 s run)."""
    made = reprise(
        "chat",
        "--model",
        str(tiny_model_dir),
        "--conversation",
        "new",
        "--max-tokens",
        "2",
        "pelican",
    )
    assert made.returncode == 0, made.stderr
    for command in READ_ONLY_COMMANDS:
        done = subprocess.run(
            [sys.executable, "-c", LOADED_AFTER, *command], capture_output=True, text=True
        )
        assert done.stdout.splitlines()[-1] == "0 []", (command, done.stdout, done.stderr)


def test_cache_verify_fails_loudly_on_a_damaged_file(tiny_model_dir):
    reprise(
        "chat",
        "--model",
        str(tiny_model_dir),
        "--conversation",
        "new",
        "--temp",
        "0",
        "--max-tokens",
        "4",
        "hello",
    )
    from sessions import paths

    victim = next((paths.cache_dir() / "kv").rglob("*.safetensors"))
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF
    victim.write_bytes(bytes(data))
    done = reprise("cache", "verify", "--json")
    assert done.returncode == 1
    assert json.loads(done.stdout)["bad"][0]["reason"].startswith("checksum mismatch")


def test_a_newer_database_gets_a_clear_message(tiny_model_dir):
    from sessions.db import open_db

    db = open_db()
    db.execute(
        "insert into _sqlite_migrations (migration_set, name, applied_at) "
        "values ('reprise', 'm999_future', '2030-01-01')"
    )
    db.conn.commit()
    done = reprise("conversations", "list")
    assert done.returncode == 1
    assert "newer version of Reprise" in done.stderr and "Traceback" not in done.stderr


def test_system_on_a_stored_chat_becomes_its_own_prompt(tiny_model_dir):
    """`--system` with `--conversation ID` sets that chat's prompt, as the window's header
    does; later turns without the flag keep it."""
    args = ("chat", "--model", str(tiny_model_dir), "--temp", "0", "--max-tokens", "3")
    made = reprise(*args, "--conversation", "new", "--json", "hello")
    conversation = str(json.loads(made.stdout)["conversation_id"])
    assert (
        reprise(*args, "--conversation", conversation, "--system", "Be terse.", "hi").returncode
        == 0
    )
    assert reprise(*args, "--conversation", conversation, "and again").returncode == 0
    exported = reprise("conversations", "export", conversation, "--format", "json")
    assert json.loads(exported.stdout)["system_prompt"] == "Be terse."


def test_a_stored_chat_restores_while_the_first_line_is_read(tiny_model_dir):
    """`reprise chat --conversation ID` starts restoring before it reads a line, so the
    first turn finds the cache already in memory."""
    args = ("chat", "--model", str(tiny_model_dir), "--temp", "0", "--max-tokens", "3")
    made = reprise(*args, "--conversation", "new", "--json", "hello there")
    record = json.loads(made.stdout)
    done = subprocess.run(
        [REPRISE, *args, "--conversation", str(record["conversation_id"]), "--json"],
        input="and then?\n", capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    turn = json.loads(done.stdout)
    assert turn["restore_source"] == "memory"
    assert turn["restored_tokens"] == record["prompt_tokens"] + record["generated_tokens"]
