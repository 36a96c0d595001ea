"""Waiting on a child of fork that must finish: a hang fails the test, not the run."""

from __future__ import annotations

import os
import time

import pytest


def assert_child_succeeds(child: int, what: str, seconds: float = 60) -> None:
    """The forked `child` exits 0 within `seconds`; killed and a failure if it hangs."""
    deadline = time.monotonic() + seconds
    while (done := os.waitpid(child, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(child, 9)
        os.waitpid(child, 0)
        pytest.fail(f"the forked child's {what} never finished")
    assert os.waitstatus_to_exitcode(done[1]) == 0
