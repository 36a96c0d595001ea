"""mlx reads some settings from the environment once, when it starts; the engine sets
them first. The one today: no "cache thrashing" fuse in mlx's CUDA caches, which
would fail every reply of an app left open for a few hundred turns."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

ROOT = Path(__file__).parents[1]
FUSE = "MLX_ENABLE_CACHE_THRASHING_CHECK"

# Records the variable as mlx sees it: at the moment mlx.core is first imported.
SEEN_BY_MLX = f"""
import importlib.abc, os, sys
seen = []
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "mlx.core" and not seen:
            seen.append(os.environ.get("{FUSE}"))
        return None
sys.meta_path.insert(0, Watch())
import app.engine.chat  # what the window's worker and the terminal load
print(seen)
"""


def seen_by_mlx(**env_extra: str) -> str:
    env = {key: value for key, value in os.environ.items() if key != FUSE}
    done = subprocess.run(
        [sys.executable, "-c", SEEN_BY_MLX],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**env, **env_extra},
        check=True,
    )
    return done.stdout.strip()


def test_mlx_starts_without_the_cache_thrashing_fuse():
    assert seen_by_mlx() == "['0']"


def test_a_value_the_user_set_is_kept():
    assert seen_by_mlx(**{FUSE: "1"}) == "['1']"


@pytest.mark.skipif(not mx.cuda.is_available(), reason="the fuse is in mlx's CUDA backend")
def test_a_chats_stream_of_new_attention_shapes_goes_on_past_the_caches_capacity():
    """Each turn attends its new tokens to a longer history: a new cuDNN graph each
    time. mlx-cuda 0.32.4 raised on the 513th (H100, 6 December 2026) unless the fuse
    was off."""
    heads, kv_heads, dim = 16, 8, 128
    for turn in range(600):
        q = mx.zeros((1, heads, 2 + turn % 60, dim), mx.bfloat16)
        kv = mx.zeros((1, kv_heads, 100 + 7 * turn, dim), mx.bfloat16)
        out = mx.fast.scaled_dot_product_attention(q, kv, kv, scale=dim**-0.5, mask="causal")
        mx.eval(out)
