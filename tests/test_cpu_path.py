"""The engine arranges a fast BLAS for mlx on Linux by itself, and says what it chose."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
SHOW = "import app.engine.blas as b; print(b.CHOICE.name); print(b.CHOICE.note)"


def choice(code: str = SHOW, **env_extra: str) -> list[str]:
    env = {**os.environ, **env_extra}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, check=True
    )
    return done.stdout.splitlines()


linux_only = pytest.mark.skipif(
    platform.system() != "Linux", reason="OpenBLAS preload is Linux-only"
)


@linux_only
def test_openblas_is_preloaded_and_serves_mlx_matmuls():
    # `make` installs Debian's libopenblas0; mlx's cblas_sgemm must then resolve to it.
    code = SHOW + (
        "\nimport mlx.core as mx\nmx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)))"
        "\nprint([l.split()[-1] for l in open('/proc/self/maps') if 'openblas' in l][:1])"
    )
    name, note, maps = choice(code=code)
    assert name == "openblas", note
    assert "libopenblas" in maps


@linux_only
def test_openblas_can_be_turned_off():
    name, note = choice(REPRISE_OPENBLAS="off")
    assert name == "reference" and "REPRISE_OPENBLAS=off" in note


@linux_only
def test_a_late_preload_says_so():
    name, note = choice(code="import mlx.core\n" + SHOW)
    assert name == "reference" and "imported before" in note


@linux_only
def test_this_test_process_runs_on_openblas_too():
    # Guards the import order in conftest: the starter-model tests would crawl otherwise.
    from app.engine import blas

    assert blas.CHOICE.name == "openblas", blas.CHOICE.note


def test_a_4_bit_mixture_of_experts_runs_dequantized_with_its_stored_logits(
    starter_model_dir, tmp_path
):
    """A 4-bit MoE download (its experts stacked in QuantizedSwitchLinear layers) on the
    CPU path: every layer made dense, experts included (gather_qmm refused float32
    experts), and the logits those of the weights as stored."""
    import json

    import families
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    from app.engine.loading import load

    folder = families.build("moe", starter_model_dir, tmp_path)
    stored = load(folder, compute="stored")
    nn.quantize(stored.model, group_size=32, bits=4)
    weights = dict(tree_flatten(stored.model.parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, {"format": "mlx"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))

    as_stored, dense = load(folder, compute="stored"), load(folder, compute="dense")
    layers = [m for _, m in dense.model.named_modules()]
    assert any(isinstance(m, SwitchLinear) for m in layers)
    assert not any(isinstance(m, QuantizedSwitchLinear | nn.QuantizedLinear) for m in layers)
    assert dense.compute.weights.startswith("float32")
    tokens = mx.array([[5, 300, 1200, 44, 9]])
    want, got = as_stored.model(tokens), dense.model(tokens)
    assert mx.allclose(got, want.astype(mx.float32), atol=2e-2, rtol=2e-2).item()


def test_nvfp4_experts_with_a_global_scale_come_back_near_their_weights():
    """mlx-lm's nvfp4 mixture layers may keep a scale per expert over their group
    scales: the CPU path's float32 experts include it (they came out about 43,000
    times too large, and replies were noise)."""
    import mlx.core as mx
    from mlx_lm.models.switch_layers import SwitchLinear

    from app.engine.loading import _dense_weight

    mx.random.seed(0)
    experts = SwitchLinear(256, 64, 3, bias=False)
    quantized = experts.to_quantized(group_size=16, bits=4, mode="nvfp4", global_scale=True)
    assert quantized.global_scale is not None
    dense = _dense_weight(quantized, mx.float32)
    error = mx.abs(dense - experts.weight).max() / mx.abs(experts.weight).max()
    assert error.item() < 0.25  # 4-bit floats: within a step of their grid
