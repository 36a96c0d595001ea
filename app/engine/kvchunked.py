"""The quantized counterpart of mlx-lm's `ChunkedKVCache` (Llama 4's local layers).

A Llama 4 model attends, in three layers of four, only within fixed chunks of
positions. mlx-lm's `ChunkedKVCache` serves those layers: before each forward
pass the model calls `maybe_trim_front`, which keeps at most `chunk_size`
tokens by dropping the oldest and moving `start_position` (the position of the
first token held) up; the model then builds its own mask over positions
[start_position, offset + N) and hands it to attention.

`ChunkedMixedKVCache` keeps that contract and stores its tokens per a
`KVScheme`, as a `MixedKVCache` does: the tokens older than the 16-bit window
quantized, attention reading the packed cache. Like a sliding window its
tokens' places move as the front is dropped, so what is quantized follows the
window. It keeps no 16-bit sink: the first tokens are dropped with the front,
and each query sees only the tokens of its own chunk.
"""

from __future__ import annotations

from mlx_lm.models.cache import create_attention_mask

from app.engine.kvquant import MixedKVCache
from app.engine.kvscheme import KVScheme


class ChunkedMixedKVCache(MixedKVCache):
    """A drop-in for mlx-lm's ChunkedKVCache whose tokens are stored per `scheme`;
    `count` (the tokens held) is always `offset - start_position`."""

    def __init__(self, scheme: KVScheme, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        super().__init__(scheme)

    def _setup(self, scheme: KVScheme, max_size: int | None, keep: int) -> None:
        if max_size is not None or keep:
            raise ValueError("a chunked layer is not a sliding window")
        super()._setup(scheme, None, 0)
        self.sink_size = 0  # the front is dropped, first tokens included
        self.start_position = 0

    def front_moves(self) -> bool:
        return True

    def maybe_trim_front(self) -> None:
        """Hold at most `chunk_size` tokens before the next forward pass (the model
        calls it, as it calls ChunkedKVCache's)."""
        excess = self.count - self.chunk_size
        if excess > 0:
            self._drop_front(excess)
            self.start_position += excess

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        """A causal mask over the held tokens and `N` new ones (Llama 4 builds its
        own chunk mask; this serves model code that asks the cache)."""
        return create_attention_mask(N, self.count, return_array, window_size)

    @property
    def state(self) -> tuple:
        """MixedKVCache's state, then (chunk_size, start_position)."""
        return (*MixedKVCache.state.fget(self), self.chunk_size, self.start_position)

    @state.setter
    def state(self, state: tuple) -> None:
        *mixed, chunk_size, start_position = state
        if type(chunk_size) is not int or chunk_size <= 0:
            raise ValueError(f"a chunk size of {chunk_size!r}")
        MixedKVCache.state.fset(self, tuple(mixed))
        self.chunk_size = chunk_size
        if type(start_position) is not int or self.count != self.offset - start_position:
            raise ValueError("the held tokens do not end at the offset")
        self.start_position = start_position
