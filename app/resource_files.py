"""Files the app reads from `resources/`, installed as the package `reprise_resources`
(pyproject's package-dir): the same call works in a checkout and from a wheel."""

from __future__ import annotations

from importlib.resources import files
from importlib.resources.abc import Traversable


def resource(name: str) -> Traversable:
    """`name` under resources/, e.g. "text/ordinary-english.txt"."""
    found = files("reprise_resources")
    for part in name.split("/"):
        found = found / part
    return found


def read_text(name: str) -> str:
    return resource(name).read_text(encoding="utf-8")
