"""Bad input to `reprise chat`: every case a clear message and exit status 1 (2 for what
argparse refuses), never a traceback, and nothing stored for what was refused.

Bytes that are not UTF-8 only arrive as a user would send them through a real process
(Python decodes argv and stdin itself); the table of flags runs through `app.cli.main`
in this process, where an exception other than a user error would fail the test."""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.cli import main
from sessions.db import open_db

REPRISE = str(Path(sys.executable).with_name("reprise"))


def reprise(*args: str | bytes, stdin: bytes | None = None, **env: str):
    return subprocess.run(
        [REPRISE, *args],
        input=stdin,
        capture_output=True,
        timeout=300,
        check=False,
        env={**os.environ, **env},
    )


def stored_conversations() -> list[dict]:
    return [dict(c) for c in open_db(read_only=True)["conversations"].rows]


BAD_FLAGS = {
    ("--max-tokens", "0"): "max tokens must be a whole number of at least 1",
    ("--max-tokens", "-5"): "max tokens must be a whole number of at least 1",
    ("--max-tokens", "1000000000000"): "max tokens must be",
    ("--temp", "nan"): "temperature must be a number from 0 to 5",
    ("--temp", "inf"): "temperature must be a number from 0 to 5",
    ("--temp=-inf",): "temperature must be a number from 0 to 5",
    ("--temp", "1e400"): "temperature must be a number from 0 to 5",
    ("--temp", "-0.5"): "temperature must be a number from 0 to 5",
    ("--top-p", "nan"): "top p must be a number from 0 to 1",
    ("--top-p", "1.5"): "top p must be a number from 0 to 1",
    ("--min-p", "-1"): "min p must be a number from 0 to 1",
    ("--repetition-penalty", "0"): "repetition penalty must be a number from 0.1 to 10",
    ("--repetition-penalty", "nan"): "repetition penalty must be",
    ("--seed", "-1"): "seed must be a whole number of at least 0",
    ("--max-context", "0"): "max context must be a whole number of at least 16",
    ("--quantized-kv-start", "-1"): "quantized kv start must be a whole number of at least 0",
}


@pytest.mark.parametrize("flag", list(BAD_FLAGS), ids=" ".join)
def test_an_invalid_flag_names_its_rule(flag, capsys):
    assert main(["chat", *flag, "--conversation", "new", "hello"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"reprise: {BAD_FLAGS[flag]}") and err.count("\n") == 1
    assert stored_conversations() == []


@pytest.mark.parametrize(
    "flag", [("--max-tokens", "many"), ("--max-tokens", "1.5"), ("--temp", "warm")], ids=" ".join
)
def test_a_flag_that_is_not_a_number_is_a_usage_error(flag, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["chat", *flag, "hello"])
    assert exited.value.code == 2
    assert f"argument {flag[0]}: invalid" in capsys.readouterr().err


@pytest.mark.parametrize("message", ["", " ", "\t\n  \r\n", "\u3000\u00a0"])
def test_an_empty_message_is_refused_before_anything_is_stored(message, capsys):
    assert main(["chat", "--conversation", "new", message]) == 1
    assert capsys.readouterr().err == "reprise: the message is empty; type something to send\n"
    assert stored_conversations() == []


def test_an_empty_message_from_a_real_process():
    done = reprise("chat", "--conversation", "new", "   ")
    assert (done.returncode, done.stderr) == (
        1,
        b"reprise: the message is empty; type something to send\n",
    )


NOT_UTF8 = {
    "ff-fe": b"\xff\xfe",
    "latin-1": b"caf\xe9 au lait",
    "overlong": b"\xc0\xaf",
    "encoded-surrogate": b"\xed\xa0\x80 surrogate",
    "truncated": b"cut \xe2\x82",
}
MESSAGE_NOT_UTF8 = b"reprise: the message is not valid UTF-8 text\n"


def test_a_message_or_system_prompt_that_is_not_utf8_is_refused():
    """Each case a real process of its own, run side by side."""
    cases = {case: (raw, MESSAGE_NOT_UTF8) for case, raw in NOT_UTF8.items()}
    cases["--system"] = (b"hello", b"reprise: --system is not valid UTF-8 text\n")
    running = {
        case: subprocess.Popen(
            [REPRISE, "chat", "--conversation", "new", message]
            + (["--system", "caf\xe9".encode("latin-1")] if case == "--system" else []),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for case, (message, _) in cases.items()
    }
    for case, process in running.items():
        _, err = process.communicate(timeout=300)
        assert (process.returncode, err) == (1, cases[case][1]), case
    assert stored_conversations() == []


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("abc", "--conversation takes 'new' or a number, not 'abc'"),
        ("1e3", "--conversation takes 'new' or a number, not '1e3'"),
        ("0", "No conversation 0"),
        ("-1", "No conversation -1"),
        ("7", "No conversation 7"),
        (str(2**64), f"No conversation {2**64}"),  # past SQLite's integers
    ],
)
def test_a_conversation_that_is_not_there_is_named(value, message, capsys):
    assert main(["chat", f"--conversation={value}", "hello"]) == 1
    assert capsys.readouterr().err == f"reprise: {message}\n"


@pytest.mark.parametrize(
    "command",
    [
        ["conversations", "show"],
        ["conversations", "delete"],
        ["conversations", "export"],
        ["cache", "export", "--", "{id}", "out.safetensors"],
    ],
)
@pytest.mark.parametrize("number", [0, -1, 7, 2**63, 2**64])
def test_every_command_names_a_conversation_that_is_not_there(command, number, capsys):
    """An id past SQLite's integers raised OverflowError as a traceback before."""
    args = [part.replace("{id}", str(number)) for part in command]
    if "{id}" not in command:
        args += ["--", str(number)]
    assert main(args) == 1
    assert capsys.readouterr().err == f"reprise: No conversation {number}\n"


@pytest.mark.parametrize("stdin_decoding", ["surrogateescape", "strict"])
def test_piped_input_stops_at_its_first_line_that_is_not_utf8(tiny_model_dir, stdin_decoding):
    """The lines before it are answered and stored; the bad line and every line after it
    are not; the message names the line (blank lines count, as an editor counts them)."""
    lines = b"first\n\n   \nsecond \xc3\xa9\nthird \xff\nnever sent\n"
    done = reprise(
        *("chat", "--model", str(tiny_model_dir), "--conversation", "new"),
        *("--max-tokens", "3", "--temp", "0", "--json"),
        stdin=lines,
        PYTHONIOENCODING=f"utf-8:{stdin_decoding}",
    )
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == b"reprise: input line 5 is not valid UTF-8 text"
    assert b"Traceback" not in done.stderr
    assert len(done.stdout.splitlines()) == 2  # one JSON line per reply

    [conversation] = stored_conversations()
    messages = list(
        open_db(read_only=True)["messages"].rows_where(
            "conversation_id = ?", [conversation["id"]], order_by="id"
        )
    )
    assert [m["role"] for m in messages] == ["user", "assistant"] * 2
    assert [m["content"] for m in messages[::2]] == ["first", "second \u00e9"]


def test_an_interactive_chat_names_a_bad_line_and_goes_on(tiny_model_dir):
    """At a terminal (a real pseudo-terminal), a line that is not UTF-8 gets a message
    and the prompt again; the next line is answered; Ctrl-D ends the chat."""
    controller, terminal = pty.openpty()
    process = subprocess.Popen(
        [REPRISE, "chat", "--model", str(tiny_model_dir), "--max-tokens", "3", "--json"],
        stdin=terminal,
        stdout=terminal,
        stderr=subprocess.PIPE,
    )
    os.close(terminal)
    os.write(controller, b"caf\xe9\nhello\n\x04")
    shown = _read_until_closed(controller)
    assert process.wait(timeout=300) == 0
    err = process.stderr.read()  # Python writes the "> " prompt here
    assert err.replace(b"> ", b"") == b"reprise: input line 1 is not valid UTF-8 text\n"
    [reply] = [line for line in shown.splitlines() if b'"reply"' in line]
    assert json.loads(reply[reply.index(b"{") :])["generated_tokens"] >= 1


def _sigint_as_at_a_terminal() -> None:
    """A program started in the background (`make test &`, nohup) inherits SIGINT
    ignored, and Python then keeps it ignored, as it should; a user at a terminal
    has it at its default. The test is that user, whoever started the suite."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_at_a_piped_prompt_ends_the_chat(tiny_model_dir):
    process = subprocess.Popen(
        [REPRISE, "chat", "--model", str(tiny_model_dir), "--conversation", "new"],
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=_sigint_as_at_a_terminal,
    )
    assert process.stderr.readline().startswith(b"Conversation ")
    time.sleep(1)  # waiting for a line
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=300) == 0
    assert process.stderr.read() == b""


def _read_until_closed(fd: int) -> bytes:
    """What the program wrote to its terminal, until it closed it."""
    out = b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: the other side is closed
            break
        if not chunk:
            break
        out += chunk
    os.close(fd)
    return out
