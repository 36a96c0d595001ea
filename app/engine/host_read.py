"""A restore's files read and checked into host memory on threads of their own.

What a restore raced against recomputing (`restore_race`) reads while the main
thread prefills: the files, their checksums and their headers' checks, all in
host memory, no mlx (mlx is the main thread's). What the index says of the files
is looked up before, on the main thread (`ChunkReads`): SQLite connections stay
on the thread that opened them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

from app.engine.stored_arrays import read_in_threads
from sessions.cachefiles import CacheRejected, read_file


@dataclass(frozen=True)
class ChunkReads:
    """The chunk files a restore reads, in token order: each chunk's (key, start, end,
    index row), its path, and the metadata its file must hold."""

    kv_format: str
    chunks: list[tuple[str, int, int, dict]]
    paths: list[Path]
    expected: list[dict]

    @property
    def total_bytes(self) -> int:
        return sum(row["bytes"] for *_, row in self.chunks)


class HostRead:
    """`reads` read and checked on threads (at most `ahead` files at once), from now
    on. The main thread asks how far it got (`expected_end`), takes the files in
    order as they come (`files`), or lets the read go (`cancel`)."""

    def __init__(self, reads: ChunkReads, ahead: int) -> None:
        self.reads = reads
        self.total_bytes = reads.total_bytes
        self.bytes_done = 0
        self.started = time.perf_counter()
        self.seconds = 0.0  # how long the read took, once done
        self.rejected: str | None = None
        self._read: list[tuple[dict, dict] | None] = []  # None: taken by `files`
        self._failure: BaseException | None = None
        self._stop = threading.Event()
        self._done = False
        self._changed = threading.Condition()
        calls = list(zip(reads.paths, reads.expected, strict=True))
        thread = threading.Thread(target=self._run, args=(calls, ahead), daemon=True)
        thread.start()

    def _run(self, calls: list[tuple], ahead: int) -> None:
        try:
            with closing(read_in_threads(read_file, calls, ahead)) as reads:
                for (*_, row), read in zip(self.reads.chunks, reads, strict=True):
                    with self._changed:
                        if self._stop.is_set():
                            return
                        self._read.append(read)
                        self.bytes_done += row["bytes"]
                        self._changed.notify_all()
        except (CacheRejected, OSError) as exc:
            self.rejected = exc.reason if isinstance(exc, CacheRejected) else str(exc)
        except Exception as exc:  # a bug: the race lets the read go (its reason says it)
            self._failure = exc
            self.rejected = f"the read failed ({type(exc).__name__}: {exc})"
        finally:
            with self._changed:
                self.seconds = time.perf_counter() - self.started
                self._done = True
                self._changed.notify_all()

    def done(self) -> bool:
        return self._done

    def wait(self) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self._done)

    def expected_end(self) -> float | None:
        """When the read is (or is expected to be) done, on `time.perf_counter`'s clock,
        at the rate it has read so far; None before its first file is in."""
        if self._done:
            return self.started + self.seconds
        done = self.bytes_done
        if not done:
            return None
        return self.started + (time.perf_counter() - self.started) * self.total_bytes / done

    def files(self) -> Iterator[tuple[dict, dict]]:
        """Each file's checked (tensors, metadata), in order, as soon as it is read
        (the host memory goes with the caller's use); the read's `CacheRejected` at the
        first file that failed its checks or could not be read."""
        for i in range(len(self.reads.chunks)):
            with self._changed:
                self._changed.wait_for(lambda i=i: len(self._read) > i or self._done)
                if len(self._read) <= i:
                    break
                read, self._read[i] = self._read[i], None
            yield read
        else:
            return
        if self._failure is not None:
            raise self._failure
        raise CacheRejected(self.rejected or "the read was let go")

    def cancel(self) -> None:
        """Stop after the files being read; what was read is let go."""
        self._stop.set()
        with self._changed:
            self._read = [None] * len(self._read)
