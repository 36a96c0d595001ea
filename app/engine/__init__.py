"""The engine: models, prompts and generation on MLX. No Qt here.

OpenBLAS must be loaded before mlx is first imported (see `blas`), and mlx's
settings from the environment set (see `mlx_settings`), so this package does
both before anything else; and it has the C library keep freed memory for
reuse (see `host_memory`).
"""

from app.engine import (
    blas,  # noqa: F401  (side effect: preload OpenBLAS on Linux)
    host_memory,  # noqa: F401  (side effect: glibc keeps freed memory)
    mlx_settings,  # noqa: F401  (side effect: the environment mlx reads)
)
