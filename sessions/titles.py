"""A chat's title, made from its first message."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Iterator

TITLE_LENGTH = 60


def make_title(text: str) -> str:
    """A chat's title from its first message: the first line of prose (else of code),
    without its Markdown marks, cut at a word. Lines are read only until one serves, so
    a long paste costs no more than its first lines."""
    lines = text.splitlines()
    code = (line for line in lines if not _is_fence(line))
    candidates = (_plain(line) for line in itertools.chain(_outside_code(lines), code))
    line = next((line for line in candidates if line), "")
    if len(line) <= TITLE_LENGTH:
        return line
    cut = line[: TITLE_LENGTH - 1]
    if " " in cut[TITLE_LENGTH // 2 :]:
        cut = cut[: cut.rindex(" ")]
    return cut.rstrip(" ,;:-") + "…"


def _is_fence(line: str) -> bool:
    return line.lstrip().startswith(("```", "~~~"))


def _outside_code(lines: Iterable[str]) -> Iterator[str]:
    """The lines that are not inside a fenced code block."""
    fenced = False
    for line in lines:
        if _is_fence(line):
            fenced = not fenced
        elif not fenced:
            yield line


def _plain(line: str) -> str:
    """One line without Markdown's heading, quote, list and emphasis marks."""
    line = re.sub(r"^\s*(#{1,6}\s+|>\s*|[-*+]\s+|\d+[.)]\s+)+", "", line)
    line = re.sub(r"[*_`]+", "", line)
    return " ".join(line.split())
