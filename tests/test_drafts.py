"""Drafts on disk: each chat's unsent text, read back by the next start; a damaged or
unwritable file loses drafts, never the app's start."""

from __future__ import annotations

import json

from sessions.drafts import MAX_DRAFT, Drafts


def test_drafts_come_back_in_a_new_start(tmp_path):
    path = tmp_path / "drafts.json"
    drafts = Drafts(path)
    drafts.put(3, "half a thought")
    drafts.put(0, "a new chat's first line\nand its second")
    again = Drafts(path)
    assert again.get(3) == "half a thought"
    assert again.get(0) == "a new chat's first line\nand its second"
    assert again.get(4) == ""


def test_a_sent_or_emptied_draft_is_gone(tmp_path):
    path = tmp_path / "drafts.json"
    drafts = Drafts(path)
    drafts.put(3, "to be sent")
    drafts.put(5, "to be erased")
    drafts.put(3, "")
    drafts.put(5, "   \n ")
    assert Drafts(path).get(3) == "" and Drafts(path).get(5) == ""
    assert json.loads(path.read_text()) == {}


def test_drafts_of_deleted_chats_go_and_a_new_chats_stays(tmp_path):
    path = tmp_path / "drafts.json"
    drafts = Drafts(path)
    for chat in (0, 1, 2):
        drafts.put(chat, f"draft {chat}")
    drafts.keep_only({2, 7})
    again = Drafts(path)
    assert [again.get(chat) for chat in (0, 1, 2)] == ["draft 0", "", "draft 2"]


def test_a_damaged_file_is_no_drafts(tmp_path):
    path = tmp_path / "drafts.json"
    for damaged in (b"{not json", b"[1, 2]", b"\xff\xfe\x00", b'"text"'):
        path.write_bytes(damaged)
        assert Drafts(path).get(1) == ""
    # Entries of the wrong shape are skipped, the others kept.
    path.write_text(json.dumps({"1": "kept", "x": "no id", "\u00b2": "not ascii", "2": 5}))
    drafts = Drafts(path)
    assert (drafts.get(1), drafts.get(2)) == ("kept", "")


def test_a_draft_that_cannot_be_written_is_kept_until_quit(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the folder should be")
    drafts = Drafts(blocker / "drafts.json")
    drafts.put(1, "still here")  # no error for the user
    assert drafts.get(1) == "still here"
    assert list(tmp_path.iterdir()) == [blocker]


def test_a_pasted_file_is_kept_up_to_the_limit(tmp_path):
    path = tmp_path / "drafts.json"
    Drafts(path).put(1, "x" * (MAX_DRAFT + 10))
    assert len(Drafts(path).get(1)) == MAX_DRAFT


def test_a_file_no_json_reader_survives_is_no_drafts(tmp_path):
    """An adversarial review's files: nested past Python's recursion limit, and an id of
    thousands of digits (int() refuses it)."""
    path = tmp_path / "drafts.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    assert Drafts(path).get(1) == ""
    path.write_text(json.dumps({"9" * 5000: "huge id", "7": "kept"}))
    assert Drafts(path).get(7) == "kept"


def test_any_text_a_paste_can_hold_is_kept(tmp_path):
    """A lone surrogate (from a broken paste) once made every later write fail."""
    path = tmp_path / "drafts.json"
    drafts = Drafts(path)
    drafts.put(1, "half an emoji \ud83d and more")
    drafts.put(2, "café, 東京")
    again = Drafts(path)
    assert again.get(1) == "half an emoji \ud83d and more" and again.get(2) == "café, 東京"


def test_two_windows_keep_each_others_drafts(tmp_path):
    path = tmp_path / "drafts.json"
    first, second = Drafts(path), Drafts(path)
    first.put(1, "typed in the first window")
    second.put(2, "typed in the second window")
    first.put(3, "and more in the first")
    second.keep_only({1, 2, 3})
    again = Drafts(path)
    assert [again.get(i) for i in (1, 2, 3)] == [
        "typed in the first window",
        "typed in the second window",
        "and more in the first",
    ]
