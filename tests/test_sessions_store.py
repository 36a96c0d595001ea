"""Conversations, settings and the schema in real SQLite files (no model needed)."""

from __future__ import annotations

import json
import sqlite3

import pytest
import sqlite_utils

from sessions import paths
from sessions.conversations import ConversationStore, NotFound, ReplyWriter
from sessions.db import NewerDatabase, migrations, open_db


@pytest.fixture
def store() -> ConversationStore:
    return ConversationStore(open_db())


def test_database_lives_in_the_data_dir_in_wal_mode(app_dirs):
    db = open_db()
    assert (app_dirs["data"] / "reprise.db").is_file()
    assert db.execute("pragma journal_mode").fetchone()[0] == "wal"


def test_paths_honour_the_overrides(app_dirs):
    assert paths.data_dir() == app_dirs["data"]
    assert paths.cache_dir() == app_dirs["cache"]
    assert paths.models_dir() == app_dirs["models"]


def test_migrations_from_the_first_schema_keep_the_data(app_dirs):
    path = paths.data_dir() / "reprise.db"
    old = sqlite_utils.Database(path)
    migrations.apply(old, stop_before="m002_cache_index")
    assert not old["cache_chunks"].exists()
    ConversationStore(old).create("m", title="kept")
    old.close()

    db = open_db(path)
    assert db["cache_chunks"].exists() and db["measurements"].exists()
    assert [c.title for c in ConversationStore(db).list()] == ["kept"]


def test_a_database_from_a_newer_version_is_refused_untouched(app_dirs):
    path = paths.data_dir() / "reprise.db"
    db = open_db(path)
    db.execute(
        "insert into _sqlite_migrations (migration_set, name, applied_at) "
        "values ('reprise', 'm999_from_the_future', '2030-01-01')"
    )
    db.conn.commit()
    db.conn.close()  # checkpoints the WAL into the file
    before = path.read_bytes()
    with pytest.raises(NewerDatabase, match="newer version of Reprise"):
        open_db(path)
    assert path.read_bytes() == before


def test_conversation_title_comes_from_the_first_message(store):
    conversation = store.create("model-a")
    store.add_message(conversation.id, "user", "  How do   I bake bread at home?  ")
    assert store.get(conversation.id).title == "How do I bake bread at home?"
    store.rename(conversation.id, "Bread")
    assert store.get(conversation.id).title == "Bread"


def test_list_is_newest_first(store):
    first = store.create("m")
    second = store.create("m")
    store.add_message(first.id, "user", "bump")
    assert [c.id for c in store.list()] == [first.id, second.id]


def test_branches_from_edit_and_regenerate(store):
    c = store.create("m")
    q1 = store.add_message(c.id, "user", "question")
    a1 = store.add_message(c.id, "assistant", "answer one", parent_id=q1.id)
    a2 = store.add_message(c.id, "assistant", "answer two", parent_id=q1.id)
    assert [m.content for m in store.get(c.id).messages] == ["question", "answer two"]
    assert [m.id for m in store.siblings(a2.id)] == [a1.id, a2.id]

    store.select_branch(c.id, a1.id)
    assert [m.content for m in store.get(c.id).messages] == ["question", "answer one"]


def test_select_branch_follows_to_the_newest_leaf(store):
    c = store.create("m")
    q1 = store.add_message(c.id, "user", "q1")
    a1 = store.add_message(c.id, "assistant", "a1", parent_id=q1.id)
    q2 = store.add_message(c.id, "user", "q2", parent_id=a1.id)
    store.add_message(c.id, "user", "q1 edited")  # a sibling root
    store.select_branch(c.id, q1.id)
    assert store.get(c.id).current_message_id == q2.id


def test_a_long_branch_comes_back_root_first_without_its_siblings(store):
    c = store.create("m")
    parent = None
    kept = []
    for i in range(300):
        parent = store.add_message(c.id, "user", f"turn {i}", parent_id=parent).id
        kept.append(parent)
        if i % 50 == 0:  # a regenerated reply beside it, on another branch
            store.add_message(c.id, "assistant", f"other {i}", parent_id=parent)
    store.select_branch(c.id, kept[-1])
    assert [m.id for m in store.branch(kept[-1])] == kept
    assert [m.id for m in store.branch(kept[149])] == kept[:150]


def test_a_damaged_tree_still_gives_a_branch(store):
    """A parent pointer that loops back, or names a message that is gone, ends the
    walk there instead of failing or looping; only a missing leaf is NotFound."""
    c = store.create("m")
    first = store.add_message(c.id, "user", "one")
    second = store.add_message(c.id, "assistant", "two", parent_id=first.id)
    third = store.add_message(c.id, "user", "three", parent_id=second.id)
    store.db.execute("update messages set parent_id = ? where id = ?", [third.id, first.id])
    assert [m.content for m in store.branch(third.id)] == ["one", "two", "three"]
    store.db.execute("update messages set parent_id = ? where id = ?", [first.id, first.id])
    assert [m.content for m in store.branch(second.id)] == ["one", "two"]
    store.db.execute("update messages set parent_id = 999999 where id = ?", [first.id])
    assert [m.content for m in store.branch(third.id)] == ["one", "two", "three"]
    with pytest.raises(NotFound):
        store.branch(999999)


def test_full_text_search_finds_words_in_any_order(store):
    c = store.create("m")
    store.add_message(c.id, "user", "The quick brown fox")
    other = store.create("m")
    store.add_message(other.id, "user", "A lazy dog sleeps")
    hits = store.search("fox quick")
    assert [(conv.id, m.content) for conv, m in hits] == [(c.id, "The quick brown fox")]
    assert store.search("sleeping")[0][0].id == other.id  # porter stemming
    assert store.search('"') == []


def test_delete_removes_messages_and_search_hits(store):
    c = store.create("m")
    store.add_message(c.id, "user", "unique-word-here")
    store.delete(c.id)
    with pytest.raises(NotFound):
        store.get(c.id)
    assert store.search("unique") == []


def test_export_markdown_and_json(store):
    c = store.create("m", system_prompt="Be kind.")
    q = store.add_message(c.id, "user", "Hi")
    store.add_message(c.id, "assistant", "Hello! ```py\nprint(1)\n```", parent_id=q.id)
    markdown = store.export(c.id, "markdown")
    assert markdown.startswith("# Hi") and "**Assistant:**" in markdown and "print(1)" in markdown
    data = json.loads(store.export(c.id, "json"))
    assert [m["role"] for m in data["messages"]] == ["user", "assistant"]
    assert data["system_prompt"] == "Be kind."


def test_a_markdown_export_closes_what_a_stopped_reply_left_open(store):
    """Found on a new-user walk: a reply stopped inside a code block made every later
    message of the export read as code, and nothing said it had been stopped."""
    c = store.create("m", system_prompt="Be kind.\nBe brief.")
    q = store.add_message(c.id, "user", "Show me code")
    cut = store.add_message(
        c.id, "assistant", "Sure:\n```python\nfor i in range(", parent_id=q.id, state="cancelled"
    )
    again = store.add_message(c.id, "user", "Go on", parent_id=cut.id)
    store.add_message(c.id, "assistant", "~~~\nrange(3))\n~~~\nDone.", parent_id=again.id)
    lines = store.export(c.id, "markdown").splitlines()
    assert lines[4:6] == ["> System: Be kind.", "> Be brief."]
    stopped = lines.index("for i in range(")
    assert lines[stopped + 1 : stopped + 4] == ["```", "", "*(stopped)*"]
    finished = lines.index("Done.")
    assert "*(stopped)*" not in lines[finished:]
    assert lines.count("```") == 1 and lines.count("~~~") == 2  # a closed block stays as it was


@pytest.mark.parametrize(
    ("reply", "state"),
    [
        ("Here:\n```python\nx = 1", "cancelled"),  # stopped inside a block
        ("Here:\n````\nsome ``` code", "interrupted"),  # a longer fence, then a kill
        ("~~~\n```\nstill code", "failed"),
        ("```ls -la``` lists the files.", "complete"),  # inline code, not a fence
        ("```\n```js is how you start\n```", "complete"),  # not a closing fence
        ("Plain text.", "complete"),
    ],
)
def test_no_later_message_of_an_export_reads_as_code(store, reply, state):
    """Read by a CommonMark parser, as any Markdown viewer would (an adversarial review
    of the fix above found complete replies it broke)."""
    from markdown_it import MarkdownIt

    c = store.create("m")
    q = store.add_message(c.id, "user", "Question")
    a = store.add_message(c.id, "assistant", reply, parent_id=q.id, state=state)
    store.add_message(c.id, "user", "The next question", parent_id=a.id)
    tokens = MarkdownIt("commonmark").parse(store.export(c.id, "markdown"))
    code = [t.content for t in tokens if t.type in ("fence", "code_block")]
    assert not any("The next question" in block for block in code)
    shown = [t.content for t in tokens if t.type == "inline"]
    marks = "\n".join(shown)
    assert ("(stopped)" in marks) == (state in ("cancelled", "interrupted"))
    assert ("(failed)" in marks) == (state == "failed")


def test_reply_writer_commits_at_intervals_and_at_the_end(store, app_dirs):
    c = store.create("m")
    reply = store.add_message(c.id, "assistant", "", state="streaming")
    writer = ReplyWriter(store, reply.id, interval=0.0)
    writer.append("Hel")
    # Another connection (another process, say) sees the text already.
    other = sqlite3.connect(app_dirs["data"] / "reprise.db")
    assert other.execute("select content from messages where id = ?", [reply.id]).fetchone() == (
        "Hel",
    )
    writer.finish("complete", {"generated_tokens": 2}, "Hello")
    m = store.message(reply.id)
    assert (m.content, m.state, m.stats) == ("Hello", "complete", {"generated_tokens": 2})


def test_a_reply_faster_than_one_interval_has_its_first_words_on_disk(store, app_dirs):
    c = store.create("m")
    reply = store.add_message(c.id, "assistant", "", state="streaming")
    writer = ReplyWriter(store, reply.id, interval=3600)
    writer.append("Hel")
    writer.append("lo")  # within the interval: not committed yet
    other = sqlite3.connect(app_dirs["data"] / "reprise.db")
    row = other.execute("select content, state from messages where id = ?", [reply.id])
    assert row.fetchone() == ("Hel", "streaming")


@pytest.mark.parametrize(
    ("first_message", "title"),
    [
        ("What is the capital of France?", "What is the capital of France?"),
        ("# Help me\n\nwith this", "Help me"),
        ("```python\nprint(1)\n```\nWhy does this print 1?", "Why does this print 1?"),
        ("```\nonly code here\n```", "only code here"),
        ("> quoted\nmore", "quoted"),
        (
            "**Explain** the `map` function in Python and why it returns an iterator, please",
            "Explain the map function in Python and why it returns an…",
        ),
    ],
)
def test_a_title_is_the_first_line_of_prose_in_plain_words(tmp_path, first_message, title):
    store = ConversationStore(open_db(tmp_path / "t.db"))
    conversation = store.create("m")
    store.add_message(conversation.id, "user", first_message)
    assert store.get(conversation.id).title == title
