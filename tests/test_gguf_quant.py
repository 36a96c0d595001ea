"""Quantized GGUF files import at the precision asked for, with the values the file holds.

The blocks are decoded from the file's bytes by our own code; the `gguf` package's
dequantization is the reference. A model whose every matrix is of one type is
imported, and its logits compared with the reference model given the exactly
dequantized weights: types stored as they are (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K) differ
only by float16 rounding; types quantized again (Q2_K, Q3_K, Q6_K, or any type at
the bits asked for) give the logits of that reference quantized by mlx itself; and
the stored weights are about the GGUF's size.
"""

from __future__ import annotations

import json

import gguf
import gguf_models as gm
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model

from app.engine.gguf_child import import_in_child
from app.engine.gguf_kquants import QUANTIZED_TYPES, decode

# Random bytes are valid K-quant blocks; only the float16 super-block scales (at
# these byte offsets) are fixed, small, so that the weights stay in a sane range.
_KQUANT_SCALES = {
    "Q2_K": (80, b"\x00\x1c\x00\x1c"),  # d, dmin = 2^-8
    "Q3_K": (108, b"\x00\x14"),  # d = 2^-10
    "Q4_K": (0, b"\x00\x0c\x00\x0c"),  # d, dmin = 2^-12
    "Q5_K": (0, b"\x00\x08\x00\x08"),  # d, dmin = 2^-13
    "Q6_K": (208, b"\x00\x04"),  # d = 2^-14
}
# bits as the file; stored exactly; the most the stored matrices may weigh against
# the GGUF's
_EXPECTED = {
    "Q4_0": (4, True, 1.12),
    "Q4_1": (4, True, 1.01),
    "Q8_0": (8, True, 1.07),
    "Q4_K": (4, True, 1.12),
    "Q5_K": (5, True, 1.10),
    "Q6_K": (8, False, 1.38),
    "Q3_K": (4, False, 1.46),
    "Q2_K": (4, False, 1.91),
}
_TOLERANCE = 0.01  # the largest logit difference, relative to the largest logit
# Every matrix's rows whole 256-value blocks
_SHAPE = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
_PROMPT = mx.array([[5, 70, 99, 3, 180, 260, 42, 11]])


def _blocks(values: np.ndarray, type_name: str, rng) -> np.ndarray:
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name not in _KQUANT_SCALES:
        return gguf.quants.quantize(values, qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(values.size // block, size), dtype=np.uint8)
    start, scales = _KQUANT_SCALES[type_name]
    raw[:, start : start + len(scales)] = np.frombuffer(scales, dtype=np.uint8)
    return raw.reshape(values.shape[0], -1)


@pytest.mark.parametrize("type_name", QUANTIZED_TYPES)
def test_blocks_decode_as_the_gguf_package_does(type_name):
    rng = np.random.default_rng(1)
    raw = _blocks(np.zeros((16, 256), dtype=np.float32), type_name, rng)
    if type_name not in _KQUANT_SCALES:  # quantized zeros: use random values instead
        raw = gguf.quants.quantize(
            rng.normal(size=(16, 256)).astype(np.float32), gguf.GGMLQuantizationType[type_name]
        )
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(-1)
    np.testing.assert_allclose(
        decode(type_name, raw.reshape(-1)).values(), expected, rtol=1e-6, atol=1e-7
    )


def _quantized_model(tmp_path, type_name: str, matrices: str = "all"):
    """A qwen3 GGUF (no Q/K permutation to undo in the reference) whose matrices are
    all `type_name`, and the reference model given exactly the values the file holds."""
    config = gm.config("qwen3", False, **_SHAPE)
    reference = gm.reference(config)
    tensors = gm.gguf_tensors(reference, "qwen3")
    meta = gm.metadata(
        "qwen3",
        config,
        **{
            "qwen3.embedding_length": mx.array(256, dtype=mx.uint32),
            "qwen3.feed_forward_length": mx.array(512, dtype=mx.uint32),
        },
    )
    rng = np.random.default_rng(0)
    raw, exact = {}, []
    for name, value in tensors.items():
        if value.ndim != 2:
            continue
        if type_name == "F16":
            tensors[name] = value.astype(mx.float16)
            exact.append((name, tensors[name].astype(mx.float32)))
            continue
        if type_name == "BF16":  # the top half of each float32
            top = np.array(value).view(np.uint32) >> 16
            raw[name] = (top.astype(np.uint16).view(np.uint8), type_name)
            exact.append((name, mx.array((top << 16).astype(np.uint32).view(np.float32))))
            continue
        data = _blocks(np.array(value), type_name, rng)
        raw[name] = (data, type_name)
        qtype = gguf.GGMLQuantizationType[type_name]
        exact.append((name, mx.array(gguf.quants.dequantize(data, qtype))))
    path = tmp_path / f"{type_name}.gguf"
    gm.write_with_gguf_package(path, "qwen3", tensors, raw, meta)
    reference.load_weights([(_mlx_name(n), v) for n, v in exact], strict=False)
    return path, reference


def _mlx_name(gguf_name: str) -> str:
    stem = gguf_name.removesuffix(".weight")
    names = {v: k for k, v in gm.NAMES.items()}
    if stem.startswith("blk."):
        _, block, part = stem.split(".")
        return f"model.layers.{block}.{names[part]}.weight"
    return f"{names[stem]}.weight"


def _quantized_by_mlx(reference, bits: int, group: int):
    """The reference as mlx-lm's own quantization would store it."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    copy = gm.reference(vars(reference.args) | {"model_type": reference.args.model_type})
    copy.load_weights(tree_flatten(reference.parameters()))
    nn.quantize(copy, group_size=group, bits=bits)
    return copy


def _relative_error(model, reference) -> float:
    got, expected = np.array(model(_PROMPT).astype(mx.float32)), np.array(reference(_PROMPT))
    return float(np.abs(got - expected).max() / np.abs(expected).max())


def _matrix_bytes(folder) -> int:
    weights = mx.load(str(folder / "model.safetensors"))
    return sum(v.nbytes for k, v in weights.items() if "norm" not in k)


@pytest.mark.parametrize("type_name", list(_EXPECTED))
def test_quantized_files_import_at_their_own_precision(tmp_path, type_name):
    bits, exact, size_ratio = _EXPECTED[type_name]
    path, reference = _quantized_model(tmp_path, type_name)

    imported = import_in_child(path, tmp_path / "models", type_name)

    config = json.loads((imported.path / "config.json").read_text())
    assert config["quantization"]["bits"] == bits and config["quantization"]["group_size"] == 32
    assert f"{type_name} as {bits}-bit{' (exact)' if exact else ''}" in imported.weights
    model, _ = load_model(imported.path)
    if not exact:
        reference = _quantized_by_mlx(reference, bits, 32)
    assert _relative_error(model, reference) < _TOLERANCE
    from app.engine.gguf_check import check_gguf

    gguf_bytes = sum(t.size for t in check_gguf(path).tensors if len(t.dims) == 2)
    assert _matrix_bytes(imported.path) <= size_ratio * gguf_bytes


@pytest.mark.parametrize(
    ("type_name", "bits"), [("Q8_0", 4), ("Q4_K", 8), ("F16", 8), ("F16", 4), ("Q5_K", 16)]
)
def test_the_import_stores_the_precision_asked_for(tmp_path, type_name, bits):
    path, reference = _quantized_model(tmp_path, type_name)

    imported = import_in_child(path, tmp_path / "models", f"{type_name}-{bits}", bits=bits)

    config = json.loads((imported.path / "config.json").read_text())
    if bits == 16:
        assert "quantization" not in config and "float16" in imported.weights
    else:
        group = 64 if type_name == "F16" else 32  # mlx-lm's default for float weights
        assert config["quantization"] == {"group_size": group, "bits": bits}
        reference = _quantized_by_mlx(reference, bits, group)
    model, _ = load_model(imported.path)
    assert _relative_error(model, reference) < _TOLERANCE


def test_float_files_stay_float_by_default(tmp_path):
    path, reference = _quantized_model(tmp_path, "BF16")
    imported = import_in_child(path, tmp_path / "models", "bf16")
    assert "quantization" not in json.loads((imported.path / "config.json").read_text())
    assert "BF16 as float16" in imported.weights
    model, _ = load_model(imported.path)
    assert _relative_error(model, reference) < _TOLERANCE
