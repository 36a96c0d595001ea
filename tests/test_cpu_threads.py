"""OpenBLAS threads per turn from the load other processes put on the machine
(app/engine/cpu_threads.py): measured with real processes and the real /proc/stat."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from app.engine import cpu_blas, cpu_threads
from app.engine.chat import ChatSession
from app.engine.generation import TurnFinished

pytestmark = [
    pytest.mark.skipif(
        cpu_threads.sample() is None or cpu_blas.threads() is None,
        reason="needs /proc/stat and OpenBLAS",
    ),
    pytest.mark.alone,  # another test beside it is load it would count
]


@pytest.fixture(autouse=True)
def load_chooses_the_count(monkeypatch):
    """What these tests test, which the suite's fixed count (conftest) would override."""
    monkeypatch.delenv("REPRISE_BLAS_THREADS", raising=False)


def busy_process() -> subprocess.Popen:
    """A process that keeps one core busy until it is killed."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def test_a_process_keeping_a_core_busy_is_seen_as_one_busy_core():
    spinner = busy_process()
    try:
        time.sleep(0.3)  # let it start
        before = cpu_threads.sample()
        time.sleep(1.0)
        busy = cpu_threads.others_busy(before, cpu_threads.sample())
    finally:
        spinner.kill()
        spinner.wait()
    assert 0.8 <= busy <= 2.0, busy
    assert cpu_threads.threads_for(busy, 2) == 1


def test_this_processs_own_work_is_not_counted():
    before = cpu_threads.sample()
    until = time.monotonic() + 1.0
    while time.monotonic() < until:  # a core busy, but it is ours
        pass
    busy = cpu_threads.others_busy(before, cpu_threads.sample())
    assert busy < 0.6, busy  # counted, it would be about 1


def test_only_the_cores_this_process_may_use_are_read(tmp_path, monkeypatch):
    """Load on cores a container or an affinity mask keeps us off does not count."""
    stat = tmp_path / "stat"
    lines = lambda busy: [  # noqa: E731
        f"cpu  {sum(busy)} 0 0 9000 0 0 0 0 0 0",
        *(f"cpu{n} {b} 0 0 {3000 - b} 0 0 0 0 0 0" for n, b in enumerate(busy)),
        "intr 12345",
    ]
    monkeypatch.setattr(cpu_threads, "PROC_STAT", stat)
    monkeypatch.setattr(cpu_threads, "_allowed_cpus", lambda: {0, 1})
    stat.write_text("\n".join(lines([100, 100, 100])) + "\n")
    before = cpu_threads.sample()
    stat.write_text("\n".join(lines([100, 100, 2100])) + "\n")  # cpu2 busy: not ours
    after = cpu_threads.sample()
    assert after.busy == before.busy and after.total == before.total
    assert cpu_threads.cores() == 2


def test_the_free_cores_rounded_and_never_none():
    assert [cpu_threads.threads_for(b, 2) for b in (0.0, 0.4, 0.6, 1.0, 1.9, 3.0)] == [
        2,
        2,
        1,
        1,
        1,
        1,
    ]
    assert cpu_threads.threads_for(0.2, 8) == 8 and cpu_threads.threads_for(2.7, 8) == 5


def test_turns_back_to_back_keep_the_count():
    turns = cpu_threads.TurnThreads()
    assert turns.start_turn() is None  # no time has passed to judge the load by


@pytest.fixture
def restore_threads():
    count = cpu_blas.threads()
    yield
    cpu_blas.set_threads(count)


@pytest.mark.skipif(not cpu_blas.available(), reason="the CPU path's BLAS")
def test_a_turn_beside_a_busy_process_takes_one_thread(tiny_model, restore_threads, monkeypatch):
    monkeypatch.delenv("REPRISE_BLAS_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "cores", lambda: 2)
    monkeypatch.setattr(cpu_threads, "_turns", cpu_threads.TurnThreads())
    cpu_blas.set_threads(2)
    spinner = busy_process()
    try:
        time.sleep(1.0)
        events = list(ChatSession(tiny_model).generate([1, 2, 3]))
    finally:
        spinner.kill()
        spinner.wait()
    assert isinstance(events[-1], TurnFinished)  # the turn ran to its end
    assert cpu_blas.threads() == 1


def test_the_switch_fixes_the_count(restore_threads, monkeypatch):
    monkeypatch.setenv("REPRISE_BLAS_THREADS", "1")
    assert cpu_threads.TurnThreads().start_turn() == 1 and cpu_blas.threads() == 1
