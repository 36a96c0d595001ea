"""The engine: models, prompts and generation on MLX. No Qt here.

OpenBLAS must be loaded before mlx is first imported (see `blas`), so this
package does it before anything else.
"""

from app.engine import blas  # noqa: F401  (side effect: preload OpenBLAS on Linux)
