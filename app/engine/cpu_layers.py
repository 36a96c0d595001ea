"""A decode step's transformer layers on the CPU path, in numpy (issue 14).

Why: on a Linux CPU a decode step of the starter model took 44 ms on one
thread while its 211 matrix-vector products, called back to back, took 19 ms.
The rest was mlx's fixed cost per evaluation, paid several times a layer
because each product cuts the graph (`cpu_blas`): an `mx.eval` of one small
op costs about 20 µs here, `mx.fast.rms_norm` on one row 70 µs and
`mx.fast.rope` on one row's heads 140 µs, where numpy does either in 1-5 µs.

How: the blocks of llama, Mistral, Qwen2, Qwen3, Phi-3 and Gemma 3 (`LAYOUTS`)
get a subclass whose call (a decode step, a follow-up's prompt, a long prompt's
prefill chunks) does the norms, products, rotary embedding and MLP in numpy on
read-only views of the layer's float32 weights, products through `cpu_blas`
(sgemv for one row), or on its codes where the codes path kept only those
(`packed_rows`: one row through them, many through BLAS on the weight widened).
Everything that depends on the cache stays as the model does it:
`cache.update_and_fetch` with the new key and value rows, then the app's
attention router (`kvattention`), so the 16-bit, packed 8/4-bit and
sliding-window caches share one path. Any other call (a GPU, other dtypes, a
batch) is the block's own `__call__`. The weights are read once, at install: the
app never changes a loaded model's weights.

Long prompts too: their prefill was left to mlx's layers, on the guess that its
products would dwarf mlx's per-operation cost there. Measured, the numpy layers
prefilled the starter 1.3x faster at 1k tokens and 1.2x at 4k (mlx's element-wise
kernels are scalar code in the Linux wheel, and a 512-row chunk has 512 rows of
them).

The rotary embedding is whatever the layer's `rope` module computes: rotations
are linear, so the module applied once to the identity at the step's position
gives the matrix every layer with the same module settings multiplies by (one
mlx call per step, not per layer).

`REPRISE_CPU_LAYERS=off` keeps mlx's layers (benches and tests compare the two);
so does `REPRISE_CPU_GEMV=off`, which keeps mlx's matmul for every product.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from functools import cache

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import gemma3_text, llama, phi3, qwen2, qwen3

from app.engine import cpu_blas, kvattention, packed_rows

enabled = os.environ.get("REPRISE_CPU_LAYERS", "on") != "off"
# Calls of up to this many rows (decode steps, a follow-up's prompt) rotate by the
# rope's matrices, kept as pairs (`_RopeRotations`); longer ones by the module.
ROPE_MATRIX_ROWS = 64
# Calls of up to this many rows multiply by a quantized layer's codes (`_through_codes`).
MANY_ROWS = 64

_LINEAR = (nn.Linear, cpu_blas.RowLinear, nn.QuantizedLinear, cpu_blas.CodesLinear)


@dataclass(frozen=True)
class Projection:
    weight: np.ndarray | None  # (outputs, inputs) float32; None: only its codes are kept
    bias: np.ndarray | None
    packed: packed_rows.PackedWeight | None  # the weight as stored, where quantized

    @property
    def rows(self) -> int:
        return self.weight.shape[0] if self.weight is not None else self.packed.shape[0]

    @property
    def columns(self) -> int:
        return self.weight.shape[1] if self.weight is not None else self.packed.shape[1]

    @property
    def usable(self) -> bool:
        """A float32 weight laid out as sgemv reads it, or codes the C reads."""
        if self.weight is None:  # the codes path: the codes are all it has
            return self.packed is not None
        return self.weight.flags.c_contiguous


@dataclass
class _Weights:
    """One layer's weights as numpy views of mlx's float32 buffers (no copies but the
    few vectors of Gemma's norms, whose weights are stored less one)."""

    projections: dict[str, Projection]  # q, k, v, o, gate, up, down
    norms: dict[str, tuple[np.ndarray, float]]  # weight and epsilon, by place (below)
    activation: str  # of the MLP's gate: "silu" or "gelu_approx"
    rope_key: bytes


def _view(array: mx.array) -> np.ndarray:
    """A read-only numpy view of an evaluated mlx array's buffer (nothing here may
    write into the model)."""
    view = np.asarray(array)
    view.flags.writeable = False
    return view


def _linear(module: nn.Module) -> Projection:
    """Its float32 weight (none on the codes path: its codes only), bias, and codes
    where `loading` or `cpu_blas.install` gave it them."""
    bias = _view(module["bias"]) if "bias" in module else None
    weight = None if isinstance(module, nn.QuantizedLinear) else _view(module["weight"])
    return Projection(weight, bias, getattr(module, "packed_weight", None))


def _norm(module: nn.Module, offset: float = 0.0) -> tuple[np.ndarray, float]:
    weight = _view(module.weight)
    if offset:
        weight = weight + np.float32(offset)
        weight.flags.writeable = False
    return weight, module.eps


def _rows(module: nn.Module, *sizes: int) -> list[Projection]:
    """A fused projection's parts, top to bottom: views of row ranges (contiguous)."""
    whole = _linear(module)
    cuts = np.cumsum(sizes)[:-1]
    parts = np.split(whole.weight, cuts) if whole.weight is not None else [None] * len(sizes)
    biases = np.split(whole.bias, cuts) if whole.bias is not None else [None] * len(parts)
    packed = whole.packed.split(list(sizes)) if whole.packed else [None] * len(parts)
    return [Projection(*p) for p in zip(parts, biases, packed, strict=True)]


# Each family's block read as: h = x + [post_attention](attention(input(x))), then
# out = h + [post_mlp](mlp(pre_mlp(h))), the attention's queries and keys (where
# the layer has them: after the per-head norms `q` and `k`) rotated by `rope` at
# `cache.offset`; the MLP down(activation(gate(x)) * up(x)). Read against
# mlx-lm 0.32's sources of each module named here.
def _llama(block: nn.Module) -> tuple[dict, dict, str]:
    attention, mlp = block.self_attn, block.mlp
    names = {"q": attention.q_proj, "k": attention.k_proj, "v": attention.v_proj}
    names |= {"o": attention.o_proj, "gate": mlp.gate_proj, "up": mlp.up_proj}
    names["down"] = mlp.down_proj
    if any(type(m) not in _LINEAR for m in names.values()):
        return {}, {}, ""
    norms = {
        "input": _norm(block.input_layernorm),
        "pre_mlp": _norm(block.post_attention_layernorm),
    }
    if hasattr(attention, "q_norm"):  # Qwen3
        norms |= {"q": _norm(attention.q_norm), "k": _norm(attention.k_norm)}
    return {name: _linear(m) for name, m in names.items()}, norms, "silu"


def _phi3(block: nn.Module) -> tuple[dict, dict, str]:
    attention, mlp = block.self_attn, block.mlp
    if any(type(m) not in _LINEAR for m in (attention.qkv_proj, attention.o_proj)):
        return {}, {}, ""
    if any(type(m) not in _LINEAR for m in (mlp.gate_up_proj, mlp.down_proj)):
        return {}, {}, ""
    q_size = attention.n_heads * attention.head_dim
    kv_size = attention.n_kv_heads * attention.head_dim
    q, k, v = _rows(attention.qkv_proj, q_size, kv_size, kv_size)
    down = _linear(mlp.down_proj)
    hidden = down.columns
    gate, up = _rows(mlp.gate_up_proj, hidden, hidden)
    projections = {"q": q, "k": k, "v": v, "o": _linear(attention.o_proj), "gate": gate, "up": up}
    projections["down"] = down
    norms = {
        "input": _norm(block.input_layernorm),
        "pre_mlp": _norm(block.post_attention_layernorm),
    }
    return projections, norms, "silu"


def _gemma3(block: nn.Module) -> tuple[dict, dict, str]:
    projections, _, _ = _llama(block)
    attention = block.self_attn
    norms = {  # Gemma's RMS norms multiply by one plus their weight
        "input": _norm(block.input_layernorm, 1),
        "post_attention": _norm(block.post_attention_layernorm, 1),
        "pre_mlp": _norm(block.pre_feedforward_layernorm, 1),
        "post_mlp": _norm(block.post_feedforward_layernorm, 1),
        "q": _norm(attention.q_norm, 1),
        "k": _norm(attention.k_norm, 1),
    }
    return projections, norms, "gelu_approx"


LAYOUTS = {
    llama.TransformerBlock: _llama,
    qwen2.TransformerBlock: _llama,
    qwen3.TransformerBlock: _llama,
    phi3.TransformerBlock: _phi3,
    gemma3_text.TransformerBlock: _gemma3,
}


def _rope_matrices(rope: nn.Module, dims: int, offset: int, rows: int = 1) -> np.ndarray:
    """M (rows, dims, dims) such that a row at position offset + r is rotated as
    `row @ M[r]`: each basis vector as a head of its own, at every position, rotated
    by the module itself."""
    identity = mx.broadcast_to(mx.eye(dims, dtype=mx.float32)[None, :, None], (1, dims, rows, dims))
    return np.array(rope(identity, offset=offset)[0].swapaxes(0, 1))


def _rope_key(rope: nn.Module, dims: int) -> bytes:
    """Equal for modules that rotate alike: of one class, with the same settings
    and arrays (a dynamic rope's differ only past its maximum position), and the
    same matrices at a few positions."""
    digest = hashlib.sha1(type(rope).__qualname__.encode())
    for name, value in sorted(vars(rope).items()):
        if isinstance(value, (bool, int, float, str, type(None))):
            digest.update(f"{name}={value!r};".encode())
    for name, value in sorted(rope.items()):
        if isinstance(value, mx.array):
            digest.update(name.encode() + np.array(value).tobytes())
    for offset in (1, 37, 4099):
        digest.update(_rope_matrices(rope, dims, offset).tobytes())
    return digest.digest()


def _weights(block: nn.Module) -> _Weights | None:
    """The block's arrays, or None where it keeps mlx's layers: not all float32 (or
    the codes of the codes path), or laid out otherwise than the products read."""
    arrays = [v for _, v in tree_flatten(block.parameters())]
    if any(a.dtype not in (mx.float32, mx.uint32) for a in arrays):
        return None
    mx.eval(arrays)
    projections, norms, activation = LAYOUTS[type(block)](block)
    if not projections or not all(p.usable for p in projections.values()):
        return None
    attention = block.self_attn
    head_dim = projections["q"].rows // attention.n_heads
    return _Weights(projections, norms, activation, _rope_key(attention.rope, head_dim))


@dataclass(frozen=True)
class _Rotation:
    """The rotary embedding at the positions of a call's rows. Each column of a
    rotation matrix holds at most two entries (it turns pairs of dimensions), so
    `x @ M` is `x * same + x[..., partner] * other`: two products a value where the
    matrix product took 15-40 µs a call. `matrices` alone where a module's are not
    so (the product then)."""

    matrices: np.ndarray | None  # (rows, dims, dims), kept where not pairs
    partner: np.ndarray | None  # (dims,) the dimension each is turned with
    same: np.ndarray | None  # (rows, 1, dims)
    other: np.ndarray | None  # (rows, 1, dims)

    @classmethod
    def of(cls, matrices: np.ndarray) -> _Rotation:
        dims = matrices.shape[-1]
        off_diagonal = (matrices != 0).any(axis=0) & ~np.eye(dims, dtype=bool)  # [from, to]
        if (off_diagonal.sum(axis=0) > 1).any():
            return cls(matrices, None, None, None)
        columns = np.arange(dims)
        partner = np.where(off_diagonal.any(axis=0), off_diagonal.argmax(axis=0), columns)
        same = matrices[:, columns, columns]
        other = np.where(partner != columns, matrices[:, partner, columns], 0)
        rebuilt = np.zeros_like(matrices)
        rebuilt[:, partner, columns] = other
        rebuilt[:, columns, columns] += same
        if not np.array_equal(rebuilt, matrices):
            return cls(matrices, None, None, None)
        return cls(None, partner, same[:, None], other[:, None])  # 8 MB for 512 rows: not kept

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """Rows `x` (rows, heads, dims), each turned as at its position."""
        if self.partner is None:
            return cpu_blas.stacked_matmul(x, self.matrices)
        # Into a C-ordered array: x[..., partner] is laid out otherwise, and the
        # attention's compiled products take C-ordered queries only.
        out = np.take(x, self.partner, axis=-1, out=np.empty_like(x))
        out *= self.other
        out += x * self.same
        return out


class _RopeRotations:
    """The rotations of the calls under way, by kind of rope module and positions; a
    few are kept (two sessions may decode at once)."""

    KEEP = 16

    def __init__(self) -> None:
        self._rotations: dict[tuple[bytes, int, int], _Rotation] = {}

    def get(self, rope: nn.Module, key: bytes, dims: int, offset: int, rows: int) -> _Rotation:
        rotation = self._rotations.get((key, offset, rows))
        if rotation is None:
            rotation = _Rotation.of(_rope_matrices(rope, dims, offset, rows))
            if len(self._rotations) >= self.KEEP:
                self._rotations.clear()
            self._rotations[key, offset, rows] = rotation
        return rotation


_ROPES = _RopeRotations()


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMS norm of each row of `x` (the last axis), as mx.fast.rms_norm."""
    mean_square = np.einsum("...i,...i->...", x, x)[..., None] / np.float32(x.shape[-1])
    return x * (1 / np.sqrt(mean_square + np.float32(eps))) * weight


def _norm_rows(x: np.ndarray, weights: _Weights, place: str) -> np.ndarray:
    weight, eps = weights.norms[place]
    return _rms_norm(x, weight, eps)


def _product(weights: _Weights, name: str, x: np.ndarray) -> np.ndarray:
    """Rows `x` (rows, inputs) through a projection: `cpu_blas.row_product` for one
    (the weight as stored where it was quantized), the codes for a short turn's few
    (`_through_codes`), else `cpu_blas.matmul`."""
    p = weights.projections[name]
    if len(x) == 1:
        out = cpu_blas.row_product(p.weight, x[0], p.packed)[None]
    elif _through_codes(p, len(x)):
        out = packed_rows.rows_product(p.packed, x, cpu_blas.threads() or 1)
    else:
        weight = p.weight if p.weight is not None else packed_rows.widened(p.packed)
        out = cpu_blas.matmul(x, weight.T)
    return out if p.bias is None else np.add(out, p.bias, out=out)


def _through_codes(p: Projection, rows: int) -> bool:
    """A short turn's rows through a quantized layer's codes (`packed_rows.rows_product`),
    where its AVX-512 build runs: float32 products read four times the bytes (100
    weights of 1536 x 576, 17 rows: 24 ms against sgemm's 34 on two threads, 36 against
    60 on one; level by 64 rows)."""
    return (
        2 <= rows <= MANY_ROWS
        and packed_rows.usable(p.packed)
        and packed_rows.many_rows_take(p.packed)
        and _many_rows_fast()
    )


@cache
def _many_rows_fast() -> bool:
    return packed_rows.many_rows_faster_here()


def _attention(block: nn.Module, weights: _Weights, x: np.ndarray, mask, cache) -> np.ndarray:
    """The attention half for rows `x` (already normed, one per position from
    `cache.offset` on): its output projection's rows."""
    attention = block.self_attn
    rows = len(x)
    q = _product(weights, "q", x).reshape(rows, attention.n_heads, -1)
    k = _product(weights, "k", x).reshape(rows, attention.n_kv_heads, -1)
    v = _product(weights, "v", x).reshape(rows, attention.n_kv_heads, -1)
    if "q" in weights.norms:
        q, k = _norm_rows(q, weights, "q"), _norm_rows(k, weights, "k")
    dims = q.shape[-1]
    if rows <= ROPE_MATRIX_ROWS:
        rotate = _ROPES.get(attention.rope, weights.rope_key, dims, cache.offset, rows)
        q, k = rotate(q), rotate(k)
    else:
        q, k = (_rope_in_mlx(attention.rope, x, cache.offset) for x in (q, k))
    keys, values = cache.update_and_fetch(_heads_first(k), _heads_first(v))
    out = kvattention.scaled_dot_product_attention(
        _heads_first(q), keys, values, cache=cache, scale=attention.scale, mask=mask
    )
    mx.eval(out)
    return _product(weights, "o", np.asarray(out)[0].swapaxes(0, 1).reshape(rows, -1))


def _rope_in_mlx(rope: nn.Module, x: np.ndarray, offset: int) -> np.ndarray:
    """Rows `x` (rows, heads, dims) rotated by the module itself: for a long prompt's
    chunk, whose matrices (rows x dims x dims: 134 MB for 512 rows of Gemma 3's 256
    dimensions) would cost more than one mlx call."""
    out = rope(_heads_first(x), offset=offset)
    mx.eval(out)
    return np.array(out)[0].swapaxes(0, 1)


def _heads_first(x: np.ndarray) -> mx.array:
    """(rows, heads, dims) as mlx-lm's (1, heads, rows, dims)."""
    return mx.array(x.swapaxes(0, 1)[None])


def _activated(gate: np.ndarray, activation: str) -> np.ndarray:
    """silu or mlx's gelu_approx of `gate`, in place."""
    if activation == "silu":
        with np.errstate(over="ignore"):  # exp(-gate) is inf below -88: gate / inf = -0
            return np.divide(gate, 1 + np.exp(-gate), out=gate)
    inner = np.tanh(np.float32(np.sqrt(2 / np.pi)) * (gate + np.float32(0.044715) * gate**3))
    inner += 1
    gate *= inner
    gate *= np.float32(0.5)
    return gate


def _mlp(weights: _Weights, x: np.ndarray) -> np.ndarray:
    gate, up = _product(weights, "gate", x), _product(weights, "up", x)
    gate = _activated(gate, weights.activation)
    gate *= up
    return _product(weights, "down", gate)


def _row_call(self, base: type, x: mx.array, mask=None, cache=None) -> mx.array:
    weights = self.__dict__.get("_row_weights")
    if not (enabled and cpu_blas.enabled and weights and cache is not None and _rows_of_one(x)):
        return base.__call__(self, x, mask, cache)
    mx.eval(x)
    rows = np.asarray(x)[0]
    r = _attention(self, weights, _norm_rows(rows, weights, "input"), mask, cache)
    if "post_attention" in weights.norms:
        r = _norm_rows(r, weights, "post_attention")
    h = rows + r
    r = _mlp(weights, _norm_rows(h, weights, "pre_mlp"))
    if "post_mlp" in weights.norms:
        r = _norm_rows(r, weights, "post_mlp")
    h += r
    return mx.array(h[None])


def _rows_of_one(x: mx.array) -> bool:
    """Float32 rows of one sequence (a chat's; a batch keeps mlx's layers)."""
    return x.ndim == 3 and x.shape[0] == 1 and x.dtype == mx.float32


_SUBCLASSES: dict[type, type] = {}


def _row_class(block_class: type) -> type:
    if block_class not in _SUBCLASSES:

        def call(self, x: mx.array, mask=None, cache=None) -> mx.array:
            return _row_call(self, block_class, x, mask, cache)

        name = f"Row{block_class.__name__}"
        _SUBCLASSES[block_class] = type(name, (block_class,), {"__call__": call})
    return _SUBCLASSES[block_class]


def codes_layers(model: nn.Module) -> frozenset[str]:
    """The paths of the quantized layers the codes path keeps as codes (their scales
    then in float32; no float32 copy of them is made): the projections of `model`'s
    known blocks, its embedding and its output layer, where the products read their
    packing."""
    kept = set()
    for name, module in model.named_modules():
        if type(module) in LAYOUTS:
            kept.update(
                f"{name}.{inner}"
                for inner, layer in module.named_modules()
                if isinstance(layer, nn.QuantizedLinear) and packed_rows.readable(layer)
            )
        elif embedding_or_head(name, module) and packed_rows.readable(module):
            kept.add(name)
    return frozenset(kept)


def embedding_or_head(name: str, module: nn.Module) -> bool:
    """A model's quantized embedding, or its output layer (by mlx-lm's name for it)."""
    if isinstance(module, nn.QuantizedEmbedding):
        return True
    return type(module) is nn.QuantizedLinear and name.rsplit(".", 1)[-1] == "lm_head"


def install(model: nn.Module) -> int:
    """Give `model`'s known float32 blocks their one-row numpy step; returns how many.
    Each keeps its parameters and module tree: only its class changes, to a subclass
    whose one-row call is the numpy step."""
    count = 0
    for _, module in model.named_modules():
        if type(module) not in LAYOUTS:
            continue
        weights = _weights(module)
        if weights is None:
            continue
        module.__class__ = _row_class(type(module))
        module._row_weights = weights
        count += 1
    return count
