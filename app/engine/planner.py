"""The planner: whether a saved cache is read back from disk or computed again.

A turn whose cache is not in memory can restore it from its files or prefill the
history again; on a fast GPU with a slow disk, recomputing can win. The planner
estimates both from what this machine has measured: the read bandwidth of
restores, and prefill rates per model and size (`prefill_size_class`), and
recomputes only when both are known and recomputing wins (`recompute_is_faster`).
Until then it restores, the cautious choice. The measurements persist in SQLite
(sessions/measurements.py), so each machine learns once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sessions.measurements import Measurements

if TYPE_CHECKING:
    from app.engine.generation import TurnStats
    from app.engine.kvstore import KVStore
    from sessions.cachefiles import ConversationCache

READ_BANDWIDTH = "read_bytes_per_s"
# What a raced restore's files, read into host memory, take to be in the cache on the
# device (app/engine/restore_race.py).
COPY_BANDWIDTH = "copy_bytes_per_s"
# Below this many tokens the planner does not bother: restoring is always cheap.
MEASURE_MIN_TOKENS = 64


def prefill_size_class(tokens: int) -> int:
    """Prefill rates are kept per power of two of the tokens prefilled: per token, a GPU
    prefills a long history many times faster than a turn of a hundred tokens (the H200:
    a 16k-token history at ~20k tokens/s, the turns that built it at a few thousand), and
    a CPU a long one somewhat slower (its attention grows with the length)."""
    return tokens.bit_length()


def nearest_rate(rates: dict[int, float], size_class: int) -> float | None:
    """The rate measured for the size class nearest `size_class`, the smaller one on a
    tie (the cautious guess on a GPU); None when nothing was measured."""
    if not rates:
        return None
    return rates[min(rates, key=lambda c: (abs(c - size_class), c))]


def recompute_is_faster(estimates: tuple[float | None, float | None]) -> bool:
    """The planner's rule: recompute only when both paths are estimated and it wins."""
    restore, recompute = estimates
    return restore is not None and recompute is not None and recompute < restore


class ReopenPlanner:
    """One engine's estimates, from `measurements`, for caches `kvstore` saves."""

    def __init__(self, measurements: Measurements, kvstore: KVStore) -> None:
        self.measurements, self.kvstore = measurements, kvstore

    def estimates(
        self, entry: ConversationCache, usable: int, prompt_tokens: int
    ) -> tuple[float | None, float | None]:
        """(restore, recompute) seconds expected for the first `usable` tokens of
        `entry`, from the measured read bandwidth and the prefill rate of the size
        nearest a recompute's, the whole prompt of `prompt_tokens` (None: not measured
        yet on this machine)."""
        size = self.kvstore.bytes_to_read(entry, usable)
        bandwidth = self.measurements.get(READ_BANDWIDTH)
        rate = nearest_rate(self._prefill_rates(), prefill_size_class(prompt_tokens))
        return (size / bandwidth if bandwidth else None, usable / rate if rate else None)

    def learn_read(self, bytes_read: int, seconds: float) -> None:
        """Blend a restore's read bandwidth into the estimate."""
        if bytes_read and seconds > 0:
            self.measurements.observe(READ_BANDWIDTH, bytes_read / seconds)

    def knows_size(self, tokens: int) -> bool:
        """Whether a prefill of about `tokens` tokens was measured: its rate is then
        the estimate, not the rate of another size's."""
        return prefill_size_class(tokens) in self._prefill_rates()

    def copy_rate(self) -> float | None:
        return self.measurements.get(COPY_BANDWIDTH)

    def learn_copy(self, bytes_copied: int, seconds: float) -> None:
        if bytes_copied and seconds > 0:
            self.measurements.observe(COPY_BANDWIDTH, bytes_copied / seconds)

    def learn_prefill_rate(self, stats: TurnStats) -> None:
        """Blend a turn's prefill rate into the estimate for its size. (`bench reopen`
        also gives it the recompute it times: what an app learns when it recomputes.)"""
        if stats.prefilled_tokens >= MEASURE_MIN_TOKENS and stats.prefill_tps:
            self.measurements.observe(self.prefill_key(stats.prefilled_tokens), stats.prefill_tps)

    def prefill_key(self, tokens: int) -> str:
        """The measurement a prefill of `tokens` tokens of this model is kept under."""
        return f"{self.prefill_prefix}{prefill_size_class(tokens)}"

    @property
    def prefill_prefix(self) -> str:
        return f"prefill_tps:{self.kvstore.fingerprint}:"

    def _prefill_rates(self) -> dict[int, float]:
        """Size class: rate, for this model (any KV preference: the cache's format
        changes a prefill's speed far less than its length does)."""
        prefix = self.prefill_prefix
        found = self.measurements.starting_with(prefix)
        sizes = {key: key.removeprefix(prefix) for key in found}
        return {int(n): found[key] for key, n in sizes.items() if n.isascii() and n.isdigit()}
