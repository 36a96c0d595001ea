"""`reprise chat`: one message, or an interactive chat, in the terminal.

Ctrl-C while a reply streams stops that reply (the conversation and its cache
stay consistent); Ctrl-C or Ctrl-D at the prompt ends the chat.
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TextIO

from app.engine.chat import ChatSession
from app.engine.generation import KVSettings, SamplingSettings, TextDelta, TurnFinished


@dataclass
class ChatOptions:
    system: str | None
    sampling: SamplingSettings
    kv: KVSettings
    as_json: bool


class StopFlag:
    def __init__(self) -> None:
        self.raised = False

    def __call__(self) -> bool:
        return self.raised


@contextmanager
def ctrl_c_stops(flag: StopFlag):
    """While active, Ctrl-C sets `flag` instead of raising KeyboardInterrupt."""
    flag.raised = False

    def handler(_signum, _frame) -> None:
        flag.raised = True

    try:
        previous = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread: no signal handling
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def run_turn(
    session: ChatSession,
    messages: list[dict],
    options: ChatOptions,
    out: TextIO,
    should_stop: Callable[[], bool],
) -> TurnFinished:
    finished = None
    for event in session.reply(
        messages,
        system=options.system,
        sampling=options.sampling,
        kv=options.kv,
        should_stop=should_stop,
    ):
        if isinstance(event, TextDelta) and not options.as_json:
            out.write(event.text)
            out.flush()
        elif isinstance(event, TurnFinished):
            finished = event
    assert finished is not None
    if options.as_json:
        record = {"reply": finished.text, "model": session.loaded.name, **finished.stats.to_dict()}
        out.write(json.dumps(record) + "\n")
    else:
        if finished.stats.finish_reason == "cancelled":
            out.write(" [stopped]")
        out.write("\n")
    out.flush()
    return finished


def chat(session: ChatSession, first_message: str | None, options: ChatOptions) -> int:
    messages: list[dict] = []
    flag = StopFlag()

    def turn(text: str) -> None:
        messages.append({"role": "user", "content": text})
        with ctrl_c_stops(flag):
            finished = run_turn(session, messages, options, sys.stdout, flag)
        messages.append({"role": "assistant", "content": finished.text})

    if first_message is not None:
        turn(first_message)
        return 0
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"Chatting with {session.loaded.name}. Ctrl-C stops a reply; Ctrl-D quits.")
    while True:
        try:
            text = input("> " if interactive else "")
        except (EOFError, KeyboardInterrupt):
            if interactive:
                print()
            return 0
        if text.strip():
            turn(text)
