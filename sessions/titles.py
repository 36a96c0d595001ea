"""A chat's title, made from its first message."""

from __future__ import annotations

import re

TITLE_LENGTH = 60


def make_title(text: str) -> str:
    """A chat's title from its first message: the first line of prose (else of code),
    without its Markdown marks, cut at a word."""
    prose = [_plain(line) for line in _outside_code(text.splitlines())]
    code = [_plain(line) for line in text.splitlines() if not line.lstrip().startswith("```")]
    line = next((line for line in [*prose, *code] if line), "")
    if len(line) <= TITLE_LENGTH:
        return line
    cut = line[: TITLE_LENGTH - 1]
    if " " in cut[TITLE_LENGTH // 2 :]:
        cut = cut[: cut.rindex(" ")]
    return cut.rstrip(" ,;:-") + "…"


def _outside_code(lines: list[str]) -> list[str]:
    """The lines that are not inside a fenced code block."""
    outside, fenced = [], False
    for line in lines:
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced:
            outside.append(line)
    return outside


def _plain(line: str) -> str:
    """One line without Markdown's heading, quote, list and emphasis marks."""
    line = re.sub(r"^\s*(#{1,6}\s+|>\s*|[-*+]\s+|\d+[.)]\s+)+", "", line)
    line = re.sub(r"[*_`]+", "", line)
    return " ".join(line.split())
