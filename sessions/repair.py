"""Start-up repairs: what a kill or a crash can leave behind, put right.

`on_start` is called once when the app (window or CLI) starts, after
`open_db`. It is safe while another Reprise runs: it never touches a
conversation another process is writing (its writer lock is held), nor a temp
file whose writer is alive, nor a chunk file whose row may be on its way.

- Replies left "streaming" by a kill are marked "interrupted", their text kept
  (the window offers Regenerate and Continue for them).
- Temp files of a save that was killed are removed.
- Index rows that are damaged or point at a missing file are dropped (the next
  turn recomputes and saves afresh).
- Once per cache format: chunk files of a format no reader accepts (older, or
  newer) are dropped, so that a save writes them anew instead of reusing them.
"""

from __future__ import annotations

import contextlib
import os
from collections import defaultdict
from pathlib import Path

import sqlite_utils

from sessions.cachefiles import CacheIndex
from sessions.chunkio import (
    FORMAT_VERSION,
    READABLE_VERSIONS,
    file_format,
    now,
    path_from_url,
    temp_path,
)
from sessions.errors import CacheRejected, database_path, storage_errors
from sessions.locks import ConversationBusy, conversation_lock

FORMAT_MARKER = "FORMAT"  # in the cache root: the format its files were last checked for


def on_start(
    db: sqlite_utils.Database, root: Path | None = None, data_dir: Path | None = None
) -> dict[str, int]:
    """Repair what an earlier process left; return what was done, by kind."""
    with storage_errors(database_path(db.conn)):
        report = {"interrupted_replies": mark_interrupted_replies(db, data_dir)}
        index = CacheIndex(db, root)
        report["temp_files"] = index.remove_stale_temp_files()
        report |= index.drop_missing()
        report["old_format_chunks"] = drop_other_formats(index)
    return report


def mark_interrupted_replies(db: sqlite_utils.Database, data_dir: Path | None = None) -> int:
    """Mark "interrupted" the streaming replies that no live process is writing."""
    streaming: dict[int, list[int]] = defaultdict(list)
    for message_id, conversation_id in db.execute(
        "select id, conversation_id from messages where state = 'streaming'"
    ).fetchall():
        if isinstance(conversation_id, int):
            streaming[conversation_id].append(message_id)
    marked = 0
    for conversation_id, message_ids in streaming.items():
        # Holding the writer lock: a process streaming into this conversation holds it.
        with contextlib.suppress(ConversationBusy), conversation_lock(conversation_id, data_dir):
            marks = ",".join("?" * len(message_ids))
            with db.conn:
                marked += db.execute(
                    "update messages set state = 'interrupted', updated = ? "
                    f"where state = 'streaming' and id in ({marks})",
                    [now(), *message_ids],
                ).rowcount
    return marked


def drop_other_formats(index: CacheIndex) -> int:
    """Delete chunks whose file is of a format this version cannot read, once per
    format version."""
    marker = index.root / FORMAT_MARKER
    with contextlib.suppress(OSError):
        if marker.read_text().strip() == FORMAT_VERSION:
            return 0
    dropped = 0
    for key, row in index.chunk_rows():
        if row is None:
            continue  # damaged rows are drop_missing's
        try:
            version = file_format(path_from_url(row["url"], index.root))
        except CacheRejected:
            continue
        if version not in READABLE_VERSIONS:
            index.delete_chunk(key)
            dropped += 1
    tmp = temp_path(marker)
    tmp.write_text(FORMAT_VERSION)
    os.replace(tmp, marker)
    return dropped
