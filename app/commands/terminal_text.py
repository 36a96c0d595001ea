"""Stored text made safe to print to a terminal.

A message is untrusted text: printed as is, an escape sequence in it could clear the
screen, rewrite what the user already read, set the window title, or put text on the
clipboard (OSC 52). Before any stored text reaches a terminal, every control sequence
(CSI, OSC and the other string commands, two-character escapes, and their 8-bit C1
forms) and every other control character is removed; newlines and tabs stay. Bidi
overrides and isolates go too, since they reorder what is read. A string command with no
terminator loses only its introducer, so its text stays visible instead of vanishing.
"""

from __future__ import annotations

import re

_SEQUENCE = re.compile(
    r"""
      (?:\x1b\[|\x9b) [\x30-\x3f]* [\x20-\x2f]* [\x40-\x7e]?     # CSI: parameters, final byte
    | (?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f]) .*? (?:\x07|\x1b\\|\x9c)  # OSC, DCS, ... to ST
    | \x1b [\x20-\x2f]* [\x30-\x7e]?                              # any other escape
    """,
    re.X | re.S,
)
# What a sequence left behind or came alone: C0 but tab and newline, DEL, C1, bidi controls.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_INTRODUCERS = "\x1b\x90\x98\x9b\x9d\x9e\x9f"
_FINISHED = re.compile(
    r"(?:\x1b\[|\x9b)[\x30-\x3f]*[\x20-\x2f]*[\x40-\x7e]"
    r"|(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f]).*?(?:\x07|\x1b\\|\x9c)"
    r"|\x1b(?![\[\]PX^_])[\x20-\x2f]*[\x30-\x7e]",
    re.S,
)
# A sequence held back while streaming longer than this is released (as plain text).
_HOLD_LIMIT = 4096


def terminal_safe(text: str) -> str:
    """`text` without control sequences or control characters, but for "\\n" and "\\t"."""
    return _CONTROL.sub("", _SEQUENCE.sub("", text.replace("\r\n", "\n")))


class TerminalStream:
    """terminal_safe for text that arrives in pieces (a streaming reply): a sequence split
    across two pieces is still removed whole, not half printed."""

    def __init__(self) -> None:
        self._held = ""

    def feed(self, piece: str) -> str:
        """What of `piece` can be printed now; an unfinished sequence at its end waits."""
        text = self._held + piece
        self._held = ""
        window = max(0, len(text) - _HOLD_LIMIT)
        last = max(text.rfind(c, window) for c in _INTRODUCERS)
        if last >= 0 and not _FINISHED.match(text, last):
            text, self._held = text[:last], text[last:]
        return terminal_safe(text)

    def flush(self) -> str:
        """Whatever is still held, once the text has ended."""
        held, self._held = self._held, ""
        return terminal_safe(held)
