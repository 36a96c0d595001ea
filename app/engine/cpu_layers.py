"""A decode step's transformer layers on the CPU path, in numpy (issue 14).

Why: on a Linux CPU a decode step of the starter model took 44 ms on one
thread while its 211 matrix-vector products, called back to back, took 19 ms.
The rest was mlx's fixed cost per evaluation, paid several times a layer
because each product cuts the graph (`cpu_blas`): an `mx.eval` of one small
op costs about 20 µs here, `mx.fast.rms_norm` on one row 70 µs and
`mx.fast.rope` on one row's heads 140 µs, where numpy does either in 1-5 µs.

How: the layers of the families that share llama's block (llama, Mistral,
Qwen2, Qwen3: `KNOWN_BLOCKS`) get a subclass whose call with one row does the
norms, products, rotary embedding and MLP in numpy on views of the layer's
float32 weights, products through `cpu_blas.gemv`. Everything that depends on
the cache stays as the model does it: `cache.update_and_fetch` with the new
key and value rows, then the app's attention router (`kvattention`), so the
16-bit, packed 8/4-bit, sliding-window and prefill paths are the same code.
Any other call (prefill, a GPU, other dtypes) is the block's own `__call__`.

The rotary embedding is whatever the layer's `rope` module computes: rotations
are linear, so the module applied once to the identity at the step's position
gives the matrix every layer with the same module settings multiplies by (one
mlx call per step, not per layer).

`REPRISE_CPU_LAYERS=off` keeps mlx's layers (benches and tests compare the two).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import llama, qwen2, qwen3

from app.engine import cpu_blas, kvattention

enabled = os.environ.get("REPRISE_CPU_LAYERS", "on") != "off"

# Blocks whose __call__ is exactly: x + attention(norm(x)), then + mlp(norm(h)),
# the attention's queries and keys (Qwen3: after a per-head RMS norm) rotated by
# `rope` at `cache.offset`, the MLP SwiGLU. Read against mlx-lm 0.32's sources.
KNOWN_BLOCKS = (llama.TransformerBlock, qwen2.TransformerBlock, qwen3.TransformerBlock)


@dataclass
class _Weights:
    """One layer's weights as numpy views of mlx's float32 buffers (no copies)."""

    input_norm: np.ndarray
    post_norm: np.ndarray
    eps: float
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    o: np.ndarray
    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray
    biases: dict  # projection name -> bias, where the layer has one
    q_norm: np.ndarray | None
    k_norm: np.ndarray | None
    rope_key: bytes


def _view(array: mx.array) -> np.ndarray:
    return np.asarray(array)


def _linear(module: nn.Module, name: str, biases: dict) -> np.ndarray:
    if "bias" in module:
        biases[name] = _view(module["bias"])
    return _view(module["weight"])


def _rope_matrix(rope: nn.Module, dims: int, offset: int) -> np.ndarray:
    """M such that the rotated row is `row @ M` at `offset`: each basis vector as a
    head of its own, rotated by the module itself."""
    identity = mx.eye(dims, dtype=mx.float32).reshape(1, dims, 1, dims)
    return np.array(rope(identity, offset=offset).reshape(dims, dims))


def _rope_key(rope: nn.Module, dims: int) -> bytes:
    """Equal for modules that rotate alike: their matrices at a few positions."""
    digest = hashlib.sha1()
    for offset in (1, 37, 4099):
        digest.update(_rope_matrix(rope, dims, offset).tobytes())
    return digest.digest()


def _weights(block: nn.Module) -> _Weights | None:
    """The block's arrays, or None when it is not all float32 (then it keeps mlx)."""
    attention, mlp = block.self_attn, block.mlp
    modules = [attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj]
    modules += [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    if any(type(m) not in (nn.Linear, cpu_blas.RowLinear) for m in modules):
        return None
    arrays = [v for _, v in tree_flatten(block.parameters())]
    if any(a.dtype != mx.float32 for a in arrays):
        return None
    mx.eval(arrays)
    if not all(np.asarray(a).flags.c_contiguous for a in arrays):  # sgemv reads them as stored
        return None
    biases: dict = {}
    q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
    head_dim = attention.q_proj.weight.shape[0] // attention.n_heads
    return _Weights(
        input_norm=_view(block.input_layernorm.weight),
        post_norm=_view(block.post_attention_layernorm.weight),
        eps=block.input_layernorm.eps,
        q=_linear(attention.q_proj, "q", biases),
        k=_linear(attention.k_proj, "k", biases),
        v=_linear(attention.v_proj, "v", biases),
        o=_linear(attention.o_proj, "o", biases),
        gate=_linear(mlp.gate_proj, "gate", biases),
        up=_linear(mlp.up_proj, "up", biases),
        down=_linear(mlp.down_proj, "down", biases),
        biases=biases,
        q_norm=None if q_norm is None else _view(q_norm.weight),
        k_norm=None if k_norm is None else _view(k_norm.weight),
        rope_key=_rope_key(attention.rope, head_dim),
    )


class _RopeMatrices:
    """The rotation matrices of the step under way, one per kind of rope module."""

    def __init__(self) -> None:
        self._offset: int | None = None
        self._matrices: dict[bytes, np.ndarray] = {}

    def get(self, rope: nn.Module, key: bytes, dims: int, offset: int) -> np.ndarray:
        if offset != self._offset:
            self._offset, self._matrices = offset, {}
        if key not in self._matrices:
            self._matrices[key] = _rope_matrix(rope, dims, offset)
        return self._matrices[key]


_ROPES = _RopeMatrices()


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMS norm of each row of `x` (the last axis), as mx.fast.rms_norm."""
    mean_square = np.einsum("...i,...i->...", x, x)[..., None] / np.float32(x.shape[-1])
    return x * (1 / np.sqrt(mean_square + np.float32(eps))) * weight


def _product(weights: _Weights, name: str, x: np.ndarray) -> np.ndarray:
    out = cpu_blas.gemv(getattr(weights, name), x)
    bias = weights.biases.get(name)
    return out if bias is None else np.add(out, bias, out=out)


def _attention(block: nn.Module, weights: _Weights, x: np.ndarray, mask, cache) -> np.ndarray:
    """The attention half for one row `x` (already normed): its output projection."""
    attention = block.self_attn
    heads, kv_heads = attention.n_heads, attention.n_kv_heads
    q = _product(weights, "q", x).reshape(heads, -1)
    k = _product(weights, "k", x).reshape(kv_heads, -1)
    v = _product(weights, "v", x).reshape(kv_heads, -1)
    if weights.q_norm is not None:
        q, k = _rms_norm(q, weights.q_norm, weights.eps), _rms_norm(k, weights.k_norm, weights.eps)
    dims = q.shape[-1]
    rotation = _ROPES.get(attention.rope, weights.rope_key, dims, cache.offset)
    q, k = cpu_blas.matmul(q, rotation), cpu_blas.matmul(k, rotation)
    keys, values = cache.update_and_fetch(mx.array(k[None, :, None]), mx.array(v[None, :, None]))
    out = kvattention.scaled_dot_product_attention(
        mx.array(q[None, :, None]), keys, values, cache=cache, scale=attention.scale, mask=mask
    )
    mx.eval(out)
    return _product(weights, "o", np.asarray(out).reshape(-1))


def _mlp(weights: _Weights, x: np.ndarray) -> np.ndarray:
    gate, up = _product(weights, "gate", x), _product(weights, "up", x)
    silu = np.exp(-gate)
    silu += 1
    np.divide(gate, silu, out=gate)
    gate *= up
    return _product(weights, "down", gate)


def _row_call(self, x: mx.array, mask=None, cache=None) -> mx.array:
    weights = self.__dict__.get("_row_weights")
    if not (enabled and weights and cache is not None and _one_row(x)):
        return super(type(self), self).__call__(x, mask, cache)
    mx.eval(x)
    row = np.asarray(x).reshape(-1)
    normed = _rms_norm(row, weights.input_norm, weights.eps)
    h = row + _attention(self, weights, normed, mask, cache)
    h += _mlp(weights, _rms_norm(h, weights.post_norm, weights.eps))
    return mx.array(h).reshape(x.shape)


def _one_row(x: mx.array) -> bool:
    return x.size == x.shape[-1] and x.dtype == mx.float32


_SUBCLASSES: dict[type, type] = {}


def _row_class(block_class: type) -> type:
    if block_class not in _SUBCLASSES:
        name = f"Row{block_class.__name__}"
        _SUBCLASSES[block_class] = type(name, (block_class,), {"__call__": _row_call})
    return _SUBCLASSES[block_class]


def install(model: nn.Module) -> int:
    """Give `model`'s known float32 blocks their one-row numpy step; returns how many.
    Each keeps its parameters and module tree: only its class changes, to a subclass
    whose one-row call is the numpy step."""
    count = 0
    for _, module in model.named_modules():
        if type(module) not in KNOWN_BLOCKS:
            continue
        weights = _weights(module)
        if weights is None:
            continue
        module.__class__ = _row_class(type(module))
        module._row_weights = weights
        count += 1
    return count
