"""Settings mlx reads from the environment once, when it starts: set here, before
anything imports mlx (`app.engine` imports this module first thing).

mlx's CUDA backend keeps small LRU caches of what it builds per shape (cuDNN
attention graphs, CUDA graphs), and each cache counts its misses over the whole
life of the process: past twice its capacity (512 for attention), every further
miss raises "Cache thrashing is happening" from inside `mx.eval`. A chat makes a
new attention shape every turn (the turn's new tokens against a longer history)
and every 512 tokens of a long prompt, so an app left open for a few hundred
turns would fail every reply after that. The caches work without the fuse: a
shape that was evicted is built again (tens of milliseconds). A value the user
set is kept. Apple silicon and the CPU have no such caches; the variable is
ignored there.
"""

from __future__ import annotations

import os

os.environ.setdefault("MLX_ENABLE_CACHE_THRASHING_CHECK", "0")
