"""Broken databases and data folders, for real: each becomes a message that says what
happened and what to do (a `UserError`), never a traceback, and nothing stored is lost."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sessions import paths
from sessions.conversations import ConversationStore
from sessions.db import DB_NAME, open_db
from sessions.errors import (
    DatabaseDamaged,
    DatabaseLocked,
    DiskFull,
    ReadOnlyStorage,
    StorageError,
)

REPRISE = str(Path(sys.executable).with_name("reprise"))
ROOT = Path(__file__).parents[2]


@pytest.fixture
def mount(tmp_path):
    """A real tmpfs of a given size (root only), remountable read-only."""
    mounted = []

    def make(size: str) -> Path:
        point = tmp_path / f"mount{len(mounted)}"
        point.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
            capture_output=True,
            check=False,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        mounted.append(point)
        return point

    yield make
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=False)


def read_only(point: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(point)], check=True)


def test_a_file_of_random_bytes_is_a_damaged_database(app_dirs):
    path = app_dirs["data"] / DB_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(64 * 1024))
    before = path.read_bytes()
    with pytest.raises(DatabaseDamaged) as raised:
        open_db()
    assert str(raised.value) == (
        f"The database at {path} is damaged (file is not a database). Move it aside to "
        "start fresh; your cache files are safe."
    )
    assert path.read_bytes() == before  # nothing was written over it


def test_damaged_pages_inside_a_database_are_a_clear_message(app_dirs):
    store = ConversationStore(open_db())
    conversation = store.create("m", title="kept")
    for n in range(300):
        store.add_message(conversation.id, "user", f"message {n} " + "words " * 300)
    store.db.conn.close()  # checkpoints the WAL into the file
    path = app_dirs["data"] / DB_NAME
    data = bytearray(path.read_bytes())
    half = len(data) // 2
    data[half:] = os.urandom(len(data) - half)
    path.write_bytes(bytes(data))

    outcomes = []
    for step in (
        lambda s: s.get(conversation.id),
        lambda s: s.search("words"),
        lambda s: s.add_message(conversation.id, "user", "one more"),
    ):
        try:
            step(ConversationStore(open_db()))
            outcomes.append("ok")
        except DatabaseDamaged as exc:
            assert "is damaged" in str(exc) and "Move it aside" in str(exc)
            outcomes.append("damaged")
    assert "damaged" in outcomes


def test_a_folder_where_the_database_should_be(app_dirs):
    (app_dirs["data"] / DB_NAME).mkdir(parents=True)
    with pytest.raises(StorageError, match="is a folder where the database should be"):
        open_db()


def test_a_read_only_data_folder(mount, monkeypatch):
    point = mount("1m")
    read_only(point)
    monkeypatch.setenv("REPRISE_DATA_DIR", str(point))
    with pytest.raises(ReadOnlyStorage, match="cannot be written"):
        open_db()
    monkeypatch.setenv("REPRISE_DATA_DIR", str(point / "not-yet-made"))
    with pytest.raises(ReadOnlyStorage, match="Read-only file system"):
        open_db()


def test_a_database_on_a_folder_that_became_read_only(mount, monkeypatch):
    point = mount("4m")
    monkeypatch.setenv("REPRISE_DATA_DIR", str(point))
    db = open_db()
    ConversationStore(db).create("m", title="kept")
    db.conn.close()
    read_only(point)
    try:
        store = ConversationStore(open_db())
    except ReadOnlyStorage as exc:  # SQLite may refuse at once (its WAL index is a file)
        assert "read-only" in str(exc)
        return
    assert [c.title for c in store.list()] == ["kept"]
    with pytest.raises(ReadOnlyStorage, match="read-only"):
        store.create("m", title="lost?")


HOLD_LOCK = textwrap.dedent("""
    import sqlite3, sys, time
    conn = sqlite3.connect(sys.argv[1], isolation_level=None)
    conn.execute("begin exclusive")
    print("locked", flush=True)
    time.sleep(60)
""")


def hold_lock(path: Path) -> subprocess.Popen:
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(path)], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().strip() == "locked"
    return child


def test_a_database_locked_by_another_process(app_dirs):
    path = app_dirs["data"] / DB_NAME
    ConversationStore(open_db()).create("m", title="kept")
    child = hold_lock(path)
    try:
        store = ConversationStore(open_db(busy_timeout_s=0.2))  # WAL: reading still works
        assert [c.title for c in store.list()] == ["kept"]
        with pytest.raises(DatabaseLocked) as raised:
            store.create("m", title="second")
        assert str(raised.value).startswith(f"The database at {path} is locked")
        assert "another Reprise" in str(raised.value)
    finally:
        child.kill()
        child.wait()
    store.create("m", title="second")  # the lock is gone with its holder
    assert {c.title for c in store.list()} == {"kept", "second"}


def test_a_new_database_locked_before_its_first_open(app_dirs):
    path = app_dirs["data"] / DB_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    sqlite3.connect(path).execute("create table placeholder (x)").connection.commit()
    child = hold_lock(path)
    try:
        with pytest.raises(DatabaseLocked, match="is locked"):
            open_db(busy_timeout_s=0.2)
    finally:
        child.kill()
        child.wait()
    assert open_db()["conversations"].exists()


def test_a_full_disk_is_a_message_and_loses_nothing_stored(mount, monkeypatch):
    point = mount("1m")
    monkeypatch.setenv("REPRISE_DATA_DIR", str(point))
    store = ConversationStore(open_db())
    conversation = store.create("m", title="kept")
    store.add_message(conversation.id, "user", "before the disk filled")
    filler = point / "filler"
    with open(filler, "wb", buffering=0) as f, pytest.raises(OSError, match="No space"):
        while True:
            f.write(b"\0" * 4096)
    with pytest.raises(DiskFull, match=r"is full\. Free some space"):
        for _ in range(200):
            store.add_message(conversation.id, "user", "x" * 20_000)
    filler.unlink()
    messages = ConversationStore(open_db()).get(conversation.id).messages
    assert messages[0].content == "before the disk filled"
    assert all(m.content in ("before the disk filled", "x" * 20_000) for m in messages)


def test_the_cli_prints_the_message_not_a_traceback(app_dirs):
    path = app_dirs["data"] / DB_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"not a database at all" * 1000)
    done = subprocess.run(
        [REPRISE, "conversations", "list"], capture_output=True, text=True, cwd=ROOT, check=False
    )
    assert done.returncode == 1
    assert done.stderr.startswith(f"reprise: The database at {path} is damaged")
    assert "Traceback" not in done.stderr
    assert paths.data_dir() == app_dirs["data"]


def test_text_that_is_not_utf8_in_one_row_costs_only_those_bytes(tmp_path):
    """Another program wrote bytes that are not UTF-8 into a title and a message: every
    conversation still lists and opens, in the library and in a real `reprise`, and the
    bad bytes read as U+FFFD."""
    path = tmp_path / DB_NAME
    store = ConversationStore(open_db(path))
    damaged = store.create("m", title="damaged")
    store.add_message(damaged.id, "user", "hello")
    intact = store.create("m", title="intact")
    store.add_message(intact.id, "user", "still here")
    raw = sqlite3.connect(path)
    raw.execute(
        "UPDATE conversations SET title = CAST(x'c0af41' AS TEXT) WHERE id = ?", [damaged.id]
    )
    raw.execute(
        "UPDATE messages SET content = CAST(x'68ff6c6c6f' AS TEXT) WHERE conversation_id = ?",
        [damaged.id],
    )
    raw.commit()
    raw.close()

    store = ConversationStore(open_db(path, read_only=True))
    assert sorted(c.title for c in store.list()) == ["intact", "\ufffd\ufffdA"]
    assert [m.content for m in store.get(damaged.id).messages] == ["h\ufffdllo"]
    assert [m.content for m in store.get(intact.id).messages] == ["still here"]
    env = {**os.environ, "REPRISE_DATA_DIR": str(tmp_path)}
    shown = subprocess.run(
        [REPRISE, "conversations", "show", str(damaged.id)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    assert "h\ufffdllo" in shown.stdout
