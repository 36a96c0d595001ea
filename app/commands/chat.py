"""`reprise chat`: one message, or an interactive chat, in the terminal.

Without `--conversation` the chat lives in memory only. With it, every turn is
stored (messages in SQLite, the KV cache on disk) and a later `reprise chat
--conversation ID` continues from the saved cache.

Ctrl-C while a reply streams stops that reply (the conversation and its cache
stay consistent); Ctrl-C or Ctrl-D at the prompt ends the chat.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

from app.engine.chat import ChatSession
from app.engine.conversation import CacheSaved, ReplyFinished
from app.engine.generation import TextDelta, TurnFinished
from app.engine.models import ModelNotFound
from app.service.chat import ChatService
from app.service.preferences import Preferences
from sessions.conversations import NotFound
from sessions.db import is_row_id, open_db
from sessions.errors import UserError
from sessions.overrides import KV_OFF, ChatOverrides

Turn = Callable[[str, Callable[[], bool]], Iterator]
log = logging.getLogger(__name__)


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

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class InvalidMessage(UserError):
    """A message that cannot be sent: empty, or not text."""


def checked_text(text: str, where: str) -> str:
    """`text` if it is text; `InvalidMessage` if not.

    Python decodes argv and stdin bytes that are not UTF-8 into lone surrogates
    (surrogateescape); they would reach the tokenizer and the database as text
    that is not text, so they are refused here, before anything is loaded or stored.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidMessage(f"{where} is not valid UTF-8 text") from None
    return text


def checked_message(text: str, where: str = "the message") -> str:
    """`text` if it can be sent: text, and not only white space."""
    if not checked_text(text, where).strip():
        raise InvalidMessage(f"{where} is empty; type something to send")
    return text


def conversation_id_from(value: str) -> int:
    """The number `--conversation` names; NotFound for what cannot be one."""
    try:
        number = int(value)
    except ValueError:
        raise NotFound(f"--conversation takes 'new' or a number, not {value!r}") from None
    if not is_row_id(number):
        raise NotFound(f"No conversation {number}")
    return number


# Each generation flag and the preference it overrides (argparse's dest: field).
FLAG_FIELDS = {
    "model": "model",
    "system": "system_prompt",
    "temp": "temperature",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_tokens": "max_tokens",
    "seed": "seed",
    "kv_bits": "kv_bits",
    "kv_group_size": "kv_group_size",
    "quantized_kv_start": "quantized_kv_start",
    "max_context": "max_context",
}


def preferences_from_args(saved: Preferences, args: argparse.Namespace) -> Preferences:
    """The saved preferences, with each flag that was given in place of its value."""
    prefs = saved.with_overrides(
        **{field: getattr(args, flag) for flag, field in FLAG_FIELDS.items()}
    )
    return replace(prefs, kv_bits=None) if args.no_kv_quantization else prefs


# The flags a stored chat keeps as its own settings (argparse's dest: field).
CHAT_FLAGS = {
    "temp": "temperature",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_tokens": "max_tokens",
    "kv_bits": "kv_bits",
}


def chat_overrides_from_args(args: argparse.Namespace) -> ChatOverrides:
    """The chat's own settings the flags give (--no-kv-quantization: its own "Off")."""
    given = {field: getattr(args, flag) for flag, field in CHAT_FLAGS.items()}
    if args.no_kv_quantization:
        given["kv_bits"] = KV_OFF
    return ChatOverrides(**given)


def print_turn(events: Iterator, as_json: bool, model: str) -> None:
    finished: ReplyFinished | TurnFinished | None = None
    saved: CacheSaved | None = None
    for event in events:
        if isinstance(event, TextDelta) and not as_json:
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif isinstance(event, ReplyFinished | TurnFinished):
            finished = event
            if not as_json:
                stopped = " [stopped]" if event.stats.finish_reason == "cancelled" else ""
                print(stopped, flush=True)
        elif isinstance(event, CacheSaved):
            saved = event
    if finished is None:
        return
    if as_json:
        stats = finished.to_dict() if isinstance(finished, ReplyFinished) else {}
        record = {"reply": finished.text, "model": model, **finished.stats.to_dict(), **stats}
        if saved is not None:
            record["cache_bytes_written"] = saved.report.bytes_written
            record["cache_chunks_written"] = saved.report.chunks_written
            record["cache_save_error"] = saved.error
        print(json.dumps(record), flush=True)
    elif saved is not None and saved.error:
        print(f"(the cache was not saved: {saved.error})", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    if args.message is not None:
        checked_message(args.message)
    if args.system is not None:
        checked_text(args.system, "--system")
    service = ChatService(open_db(handed_over=True))
    prefs = preferences_from_args(service.preferences(), args)
    if args.conversation is None:
        return _in_memory(service, prefs, args)
    service.repair()
    # Sampling and KV flags are kept as the chat's own settings, as --system is its prompt.
    own = chat_overrides_from_args(args)
    if args.conversation == "new":
        engine = service.load_model(prefs.model)
        conversation = service.create_conversation(engine.loaded.name, args.system, own)
    else:
        conversation = service.store.get(conversation_id_from(args.conversation))
        if args.system is not None:  # the flag sets this chat's own prompt, as the window does
            service.set_system_prompt(conversation.id, args.system)
        if own.given():
            service.set_chat_settings(conversation.id, conversation.overrides.merged(own))
        engine = _chat_model(service, args.model, conversation.model)
    if not args.json:
        print(f"Conversation {conversation.id}", file=sys.stderr)

    # Restore the saved cache while the first line is typed; the first turn waits for it.
    prefetch = None
    if args.message is None and args.conversation != "new":
        prefetch = threading.Thread(
            target=_prefetch, args=(service, conversation.id, prefs), daemon=True
        )
        prefetch.start()

    def stored_turn(text: str, should_stop: Callable[[], bool]) -> Iterator:
        if prefetch is not None:
            prefetch.join()  # one thread at a time on the service's connection
        return service.send(conversation.id, text, prefs, should_stop)

    return loop(stored_turn, args.message, args.json, engine.loaded.name)


def _chat_model(service: ChatService, flag: str | None, own: str):
    """The engine for a stored chat: the --model given, else the chat's own model,
    said plainly when that one is no longer installed."""
    try:
        return service.load_model(flag or own)
    except ModelNotFound as exc:
        if flag is not None:
            raise
        raise ModelNotFound(
            f"This chat was made with {own}, which is no longer installed; continue it with "
            f"another model with --model NAME. {exc}"
        ) from None


def _prefetch(service: ChatService, conversation_id: int, prefs: Preferences) -> None:
    """What fails here is only an early start: the first turn restores (or recomputes)
    as it would have, and says why."""
    try:
        service.prefetch(conversation_id, prefs)
    except Exception:
        log.warning("the saved cache could not be restored ahead", exc_info=True)


def _in_memory(service: ChatService, prefs: Preferences, args: argparse.Namespace) -> int:
    """A chat that is not stored: the model and the preferences, no database writes."""
    session = ChatSession(service.load_model(prefs.model).loaded)
    options = prefs.turn_options()
    messages: list[dict] = []

    def turn(text: str, should_stop: Callable[[], bool]) -> Iterator:
        messages.append({"role": "user", "content": text})
        for event in session.reply(
            messages,
            system=options.system,
            sampling=options.sampling,
            kv=options.kv,
            should_stop=should_stop,
            max_context=options.max_context,
        ):
            if isinstance(event, TurnFinished):
                messages.append({"role": "assistant", "content": event.text})
            yield event

    return loop(turn, args.message, args.json, session.loaded.name)


def loop(turn: Turn, first_message: str | None, as_json: bool, model: str) -> int:
    flag = StopFlag()

    def one(text: str) -> None:
        with ctrl_c_stops(flag):
            print_turn(turn(text, flag), as_json, model)

    if first_message is not None:
        one(first_message)
        return 0
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"Chatting with {model}. Ctrl-C stops a reply; Ctrl-D quits.")
    for number in itertools.count(1):
        try:
            text = _read_line(interactive, number)
        except EOFError:
            if interactive:
                print()
            return 0
        except InvalidMessage as exc:
            if not interactive:
                raise  # piped input stops at its first bad line; nothing of it is stored
            print(f"reprise: {exc}", file=sys.stderr)
            continue
        if text.strip():  # a blank line sends nothing, as in the window
            one(text)
    return 0  # not reached: the loop ends at the end of the input


def _read_line(interactive: bool, number: int) -> str:
    """The next line of input, checked; EOFError at its end (Ctrl-D or Ctrl-C).

    Piped input is read as bytes and decoded line by line, so a line that is not
    UTF-8 is named exactly, whatever decoding the platform set on stdin."""
    where = f"input line {number}"
    try:
        if interactive:
            text = input("> ")
        else:
            raw = sys.stdin.buffer.readline()
            if not raw:
                raise EOFError
            text = raw.removesuffix(b"\n").decode("utf-8")
    except KeyboardInterrupt:
        raise EOFError from None
    except UnicodeDecodeError:
        raise InvalidMessage(f"{where} is not valid UTF-8 text") from None
    return checked_message(text, where) if text.strip() else text
