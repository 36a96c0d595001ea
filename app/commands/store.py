"""`reprise conversations ...` and `reprise cache ...`: what is stored, from the terminal."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from app.commands.terminal_text import terminal_safe
from sessions.cachefiles import CacheIndex
from sessions.conversations import ConversationStore
from sessions.db import open_db


def _chat_service(db):
    """The service, for the commands that write: imported here, as it loads mlx-lm
    (about 0.8 s), which listing, showing and searching never need."""
    from app.service.chat import ChatService

    return ChatService(db)


def conversations(args: argparse.Namespace) -> int:
    store = ConversationStore(open_db())
    command = args.conversations_command
    if command == "list":
        rows = store.list()
        if args.json:
            print(json.dumps([_summary(c) for c in rows], indent=2))
        for c in [] if args.json else rows:
            title, model = terminal_safe(c.title), terminal_safe(c.model)
            print(f"{c.id:5}  {c.updated[:16].replace('T', ' ')}  {model:28.28}  {title}")
        return 0
    if command == "show":
        conversation = store.get(args.id)
        # Stored text is untrusted: its control sequences never reach the terminal.
        title, model = terminal_safe(conversation.title), terminal_safe(conversation.model)
        print(f"# {title or 'Untitled'}  ({model})")
        for m in conversation.messages:
            note = "" if m.state == "complete" else f"  [{m.state}]"
            print(f"\n{m.role}:{note}\n{terminal_safe(m.content)}")
        return 0
    if command == "search":
        hits = store.search(args.text)
        for conversation, message in hits:
            snippet = " ".join(terminal_safe(message.content).split())[:80]
            title = terminal_safe(conversation.title)[:30]
            print(f"{conversation.id:5}  {title:30}  {message.role}: {snippet}")
        return 0 if hits else 1
    if command == "delete":
        _chat_service(store.db).delete(args.id)
        print(f"Deleted conversation {args.id}")
        return 0
    if command == "export":
        if args.output:
            _chat_service(store.db).export_text(args.id, args.format, Path(args.output))
        else:
            text = store.export(args.id, args.format)
            # Exact when redirected to a file or a pipe; made safe only for a terminal.
            print(terminal_safe(text) if sys.stdout.isatty() else text)
        return 0
    return 2


def _summary(conversation) -> dict:
    return {
        "id": conversation.id,
        "title": conversation.title,
        "model": conversation.model,
        "created": conversation.created,
        "updated": conversation.updated,
    }


def cache(args: argparse.Namespace) -> int:
    db = open_db()
    index = CacheIndex(db)
    command = args.cache_command
    if command == "ls":
        rows = index.conversations_summary()
        count, size = index.usage()
        if args.json:
            print(json.dumps({"conversations": rows, "chunks": count, "bytes": size}, indent=2))
            return 0
        for r in rows:
            print(
                f"{r['conversation_id']:5}  {r['tokens']:7} tokens  {r['bytes'] / 1e6:8.1f} MB  "
                f"{r['kv_format']:8}  {r['chunks_on_disk']}/{r['chunks']} chunks  "
                f"last used {r['last_used'][:16].replace('T', ' ')}"
            )
        print(f"{count} chunk files, {size / 1e6:.1f} MB in {index.root}")
        return 0
    if command == "verify":
        bad = index.verify()
        count, _ = index.usage()
        if args.json:
            print(json.dumps({"checked": count, "bad": bad}, indent=2))
        else:
            for b in bad:
                print(f"BAD  {b['url']}: {b['reason']}")
            print(f"{count} files checked, {len(bad)} bad")
        return 1 if bad else 0
    if command == "gc":
        removed = _chat_service(db).collect_garbage()
        print(", ".join(f"{v} {k.replace('_', ' ')}" for k, v in removed.items()))
        return 0
    if command == "export":
        exported = _chat_service(db).export_cache(args.id, Path(args.out))
        print(
            f"Wrote {exported.tokens} tokens of KV cache to {exported.path}"
            + (
                f" ({exported.dequantized_layers} quantized layers written in 16 bits)"
                if exported.dequantized_layers
                else ""
            )
        )
        return 0
    return 2
