"""Restoring beside recomputing, where the planner has not measured the size.

On a GPU with memory of its own, recomputing a history can beat reading it back
(a fast GPU, a slow disk), and which wins depends on the history's size: per
token, a GPU prefills a long history several times faster than a short one. The
planner (app/engine/planner.py) decides from rates measured at each size; at a
size it has not measured it once guessed from the nearest and restored, 1.5x
slower than recomputing (an H100, 4k tokens from the disk, 1k measured).

There a turn does both at once: threads read and check the files in host memory
(`HostRead`) while the main thread prefills the history. After each prefill step,
`RestoreRace.take` compares when each would be done: the prefill at the rate it
has gone so far; the restore when its read ends (at the rate it has read so far)
or, if later, when the copy to the device that would start now ends (at the rate
restores measured, else guessed as long as the read). When the restore is expected
first, the prefill stops and the turn copies each file as it is read; when the
prefill reaches the history's end first, the read is let go. Either way the cache
holds the same tokens, the saved ones, and a file that fails its checks costs
nothing: the prefill goes on from where it stopped.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from app.engine.host_read import HostRead
from app.engine.kvstore import READ_AHEAD, KVStore, RestoreResult
from app.engine.planner import MEASURE_MIN_TOKENS, ReopenPlanner
from app.engine.stored_arrays import device_apart
from app.engine.turns import RestoreInfo
from sessions.cachefiles import CacheRejected, ConversationCache

# How much sooner the restore must be expected, as a share of the time it has left:
# the prefill's rate is steady, a read's is not (an H200's disk read the first files
# of a 16k-token cache faster than the rest; a switch on that was 1.48x late).
SURE = 0.15


def restore_is_sooner(
    now: float,
    started: float,
    prefilled: int,
    history: int,
    read_end: float | None,
    copy_s: float,
) -> bool:
    """Whether a restore whose read ends at `read_end`, its files copied from `now` on
    as they are read (`copy_s` for them all), has the `history` tokens in surely
    (`SURE`) sooner than a prefill that has put in `prefilled` of them since
    `started`, going on at that rate. No when nothing says yet when the read ends."""
    if read_end is None or prefilled <= 0:
        return False
    restore_left = max(read_end - now, copy_s)
    return restore_left * (1 + SURE) < prefill_left(now, started, prefilled, history)


def prefill_left(now: float, started: float, prefilled: int, history: int) -> float:
    """Seconds a prefill that has put in `prefilled` of `history` tokens since `started`
    takes for the rest, at that rate."""
    return (history - prefilled) * (now - started) / prefilled


@dataclass
class RaceResult:
    """How a race ended: `restored` where the turn took the restored cache (its copy
    and join took `copy_s`; it was in `ready_s` after the race began), `rejected`
    where the read failed its checks."""

    restored: RestoreResult | None = None
    rejected: str | None = None
    copy_s: float = 0.0
    ready_s: float = 0.0


class RestoreRace:
    """The restore of a history's first `history` tokens, read by `read`, raced
    against the turn's prefill. `restore` builds the cache from the finished read
    (`KVStore.restore_read`); `copy_rate`: bytes a second of that, as measured."""

    def __init__(
        self,
        read: HostRead,
        history: int,
        restore: Callable[[HostRead, Callable[[], bool]], RestoreResult],
        copy_rate: float | None,
    ) -> None:
        self.read, self.history, self.restore = read, history, restore
        self.copy_rate = copy_rate
        self.created = time.perf_counter()
        # The prefill's rate is timed from its first step, not from the race's start:
        # what comes between (the user's message stored, an SQLite commit that waits
        # behind the read on a busy disk: 70-80 ms on an H100) would be taken for
        # prefill time and multiplied by the steps still to come.
        self.prefill_started: float | None = None
        self.result: RaceResult | None = None  # None while the race is on
        # Each decision's (seconds since the race began, tokens prefilled, bytes read, the
        # read's expected end, the copy's estimate, the prefill's expected end), for
        # `bench reopen` to show how a race went.
        self.trace: list[tuple] = []

    def take(
        self, prefilled: int, should_stop: Callable[[], bool] = lambda: False
    ) -> RestoreResult | None:
        """After a prefill step that has put the prompt's first `prefilled` tokens into
        a cache begun with the race: the restored cache, when it is expected in before
        the prefill has the history (this copies each file as it is read, and lets the
        restore go at Stop); None to go on prefilling (the race is then over once the
        prefill has the history)."""
        if self.result is not None:
            return None
        if prefilled >= self.history:
            self.cancel()
            return None
        if self.read.done() and self.read.rejected is not None:
            self.result = RaceResult(rejected=self.read.rejected)  # the prefill goes on
            return None
        now = time.perf_counter()
        since = self.prefill_started or self.created
        read_end = self.read.expected_end()
        copy_s = self._copy_estimate(read_end)
        self._note(now, since, prefilled, read_end, copy_s)
        if not restore_is_sooner(now, since, prefilled, self.history, read_end, copy_s):
            return None
        return self._switch(should_stop)

    def prefill_starts(self) -> None:
        self.prefill_started = time.perf_counter()

    def _note(
        self, now: float, since: float, prefilled: int, read_end: float | None, copy_s: float
    ) -> None:
        prefill_end = now + prefill_left(now, since, prefilled, self.history)
        start = self.created
        read_s = read_end - start if read_end is not None else None
        self.trace.append(
            (now - start, prefilled, self.read.bytes_done, read_s, copy_s, prefill_end - start)
        )

    def _copy_estimate(self, read_end: float | None) -> float:
        if self.copy_rate:
            return self.read.total_bytes / self.copy_rate
        return read_end - self.read.started if read_end is not None else 0.0

    def _switch(self, should_stop: Callable[[], bool]) -> RestoreResult | None:
        restored = self.restore(self.read, should_stop)  # copies each file as it is read
        if restored.cache is None:
            self.result = RaceResult(rejected=restored.rejected)
            return None
        ready_s = time.perf_counter() - self.created
        copy_s = restored.copy_s or restored.seconds  # (no device of its own: the join)
        self.result = RaceResult(restored, None, copy_s, ready_s)
        return restored

    def cancel(self) -> None:
        """The prefill won, or the turn ended: the read is let go."""
        if self.result is None:
            self.result = RaceResult()
        self.read.cancel()


def _until_stopped(
    files: Iterator[tuple[dict, dict]], should_stop: Callable[[], bool]
) -> Iterator[tuple[dict, dict]]:
    for file in files:
        if should_stop():
            raise CacheRejected("stopped")
        yield file


def host_memory_free() -> int | None:
    """Bytes of host memory free now (None where the system does not say)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


class Races:
    """An engine's raced restores: at most one at a time, its turn's (`current`)."""

    def __init__(self, kvstore: KVStore, planner: ReopenPlanner) -> None:
        self.kvstore, self.planner = kvstore, planner
        # Whether turns race at all; None: where the GPU has memory of its own, the one
        # place recomputing can win.
        self.enabled: bool | None = None
        self.current: RestoreRace | None = None
        self.last_trace: list[tuple] = []  # the decisions of the last race, for the bench
        self.keys: list[str] = []  # the files the current race reads

    def wanted(self, usable: int, prompt_tokens: int) -> bool:
        """Whether a turn restoring `usable` tokens of a prompt of `prompt_tokens` races:
        where racing is on and the planner has measured no prefill of the prompt's size
        (what a recompute prefills, and what the race's prefill teaches when it wins)."""
        on = self.enabled if self.enabled is not None else device_apart()
        if not on or usable < MEASURE_MIN_TOKENS:
            return False  # (before the planner's query: most turns end here)
        return not self.planner.knows_size(prompt_tokens)

    def start(self, entry: ConversationCache, usable: int) -> bool:
        """Start reading `entry`'s first `usable` tokens, for the turn's prefill to race
        (False where its files cannot be raced: a checkpoint's, or none left)."""
        read = self._read_on_host(entry, usable)
        if read is None:
            return False

        def restore(done: HostRead, should_stop: Callable[[], bool]) -> RestoreResult:
            return self._restore_read(entry, usable, done, should_stop)

        held = min(usable, read.reads.chunks[-1][2])  # fewer where a chunk was evicted
        self.current = RestoreRace(read, held, restore, self.planner.copy_rate())
        self.keys = list(entry.all_keys)
        return True

    def _read_on_host(self, entry: ConversationCache, usable: int) -> HostRead | None:
        """Start reading and checking the chunk files of `entry`'s first `usable` tokens
        into host memory, on threads of their own. None where the cache is not in
        chunks alone (a checkpoint's layers restore as before) or cannot be restored."""
        store = self.kvstore
        if entry.checkpoint_keys or not store.chunked or usable <= 0:
            return None
        try:
            store.check_model(entry)
            reads = store.chunk_reads(entry, usable)
        except CacheRejected:
            return None
        room = host_memory_free()
        if not reads.chunks or (room is not None and reads.total_bytes > room // 2):
            return None  # the read holds the files in host memory until the switch
        return HostRead(reads, READ_AHEAD)

    def _restore_read(
        self,
        entry: ConversationCache,
        usable: int,
        read: HostRead,
        should_stop: Callable[[], bool],
    ) -> RestoreResult:
        """`KVStore.restore`, from the files `read` reads into host memory: each copied
        to the device (where it has memory of its own) and joined as soon as it is in;
        let go at Stop (a slow disk would otherwise hold it until the read's end)."""
        store = self.kvstore
        started, store.copy_seconds = time.perf_counter(), 0.0
        try:
            files = _until_stopped(read.files(), should_stop)
            cache, restored, size = store.join(read.reads, store.on_device(files), usable)
            if None in cache:
                raise CacheRejected("the chunks do not hold every layer")
        except CacheRejected as exc:
            return RestoreResult(None, [], time.perf_counter() - started, rejected=exc.reason)
        seconds, tokens = time.perf_counter() - started, entry.tokens[:restored]
        return RestoreResult(cache, tokens, seconds, size, copy_s=store.copy_seconds)

    def end(self, restore: RestoreInfo) -> RestoreInfo:
        """The turn's `restore` as its race ended, if it raced (the read let go where it
        is still on); what it measured is learned (a prefill let go measures nothing)."""
        race, self.current = self.current, None
        if race is None:
            return restore
        self.last_trace = race.trace  # (not the race: its result holds the chat's cache)
        race.cancel()
        result = race.result
        if result.restored is None:
            return replace(restore, rejected=result.rejected)
        restored = result.restored
        # (Not the read's bandwidth: a restore's is learned as read, copy and join in
        # all, and a race's read ran beside a prefill.)
        self.planner.learn_copy(restored.bytes_read, result.copy_s)
        return replace(
            restore,
            source="disk",
            seconds=result.ready_s,
            bytes_read=restored.bytes_read,
            tokens=len(restored.tokens),
        )
