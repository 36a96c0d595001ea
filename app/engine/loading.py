"""Load an MLX model folder and pick the fastest way to run it here.

On Apple silicon mlx runs quantized weights on the GPU and nothing needs to
change. On a Linux CPU, mlx's quantized matmul is slow (SmolLM2-135M prefilled
about 12 tokens/s) while a float32 matmul through OpenBLAS is fast, so when the
float32 weights fit comfortably in memory the engine dequantizes them once at
load time. `ComputePath` records what was chosen, for stats and the UI.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Collection
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.models.cache import KVCache
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tokenizer_utils import load as load_tokenizer
from mlx_lm.utils import load_model as mlx_lm_load_model

from app.engine import blas, cpu_blas, cpu_layers, kvattention, packed_rows
from app.engine.errors import UserError

# transformers warns, on stderr, of any text longer than the model's context it is asked
# to tokenize: the app counts such drafts to say they do not fit, and never feeds them.
logging.getLogger("transformers.tokenization_utils_base").setLevel(logging.ERROR)

# Dequantize on the CPU only while float32 weights take at most this share of RAM.
_DENSE_MEMORY_SHARE = 0.4
# The quantized layers, a mixture's stacked experts included.
_QUANTIZED = (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)


@dataclass(frozen=True)
class ComputePath:
    device: str  # "cpu" or "gpu"
    blas: str  # "openblas", "accelerate", "reference"
    weights: str  # "float32 (dequantized)", "as stored (4-bit)", ...
    note: str
    codes: bool = False  # the codes path: float32 compute, some layers kept as codes

    def describe(self) -> str:
        return f"{self.device}, {self.weights}, BLAS: {self.blas}"


@dataclass
class LoadedModel:
    name: str
    path: Path
    model: nn.Module
    tokenizer: TokenizerWrapper
    config: dict
    compute: ComputePath

    @property
    def context_length(self) -> int:
        return int(self.config.get("max_position_embeddings") or 4096)

    @cached_property
    def cache_layer_shapes(self) -> list:
        """What each layer caches per token (`codecs.LayerShape`, None for a layer that
        is not plain attention): one token through the model, once per load, so that a
        restore does not pay for it while the user waits."""
        return [shape if kind is KVCache else None for kind, shape in self.attention_shapes]

    @cached_property
    def attention_shapes(self) -> list:
        """Per layer, its cache class and what it caches per token, sliding windows too
        (`codecs.attention_shapes`): what a restored checkpoint is checked against."""
        from app.engine.codecs import attention_shapes  # codecs reads caches, a layer above

        return attention_shapes(self.model)

    @property
    def head_dim(self) -> int:
        config = self.config.get("text_config", self.config)  # llama4 nests its own
        return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


class ModelLoadError(UserError):
    pass


def load(path: Path, compute: str = "auto") -> LoadedModel:
    """Load the model folder at `path`.

    `compute` is "auto" (dequantize on CPU when it fits, else the codes path where
    it fits, else as stored), "dense" (always dequantize), "codes" (compute in
    float32, keeping the projections of the blocks `cpu_layers` knows, the embedding
    and the output layer as their codes: `cpu_layers.codes_layers`) or "stored" (run
    the weights as stored).
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} is not a model folder (no config.json)")
    try:
        model, config = mlx_lm_load_model(path)
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except (ValueError, FileNotFoundError, OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"The model in {path} could not be loaded: {exc}") from exc
    chosen = _choose_compute(model, compute)
    if chosen.weights.startswith("float32"):
        _dequantize(model, mx.float32, cpu_layers.codes_layers(model) if chosen.codes else ())
    mx.eval(model.parameters())
    if chosen.weights.startswith("float32") and cpu_blas.available():
        cpu_blas.install(model)
        cpu_layers.install(model)
    # The model's module is imported now: its attention calls go through the app's
    # router (packed KV caches, and numpy attention on the CPU path).
    kvattention.install()
    return LoadedModel(path.name, path, model, tokenizer, config, chosen)


def _choose_compute(model: nn.Module, compute: str) -> ComputePath:
    device = "gpu" if mx.default_device() == mx.gpu else "cpu"
    stored = _stored_description(model)
    if compute == "stored" or (compute == "auto" and device == "gpu"):
        return ComputePath(device, blas.CHOICE.name, f"as stored ({stored})", blas.CHOICE.note)
    if stored == "float32":
        return ComputePath(device, blas.CHOICE.name, "float32", blas.CHOICE.note)
    dense_bytes = 4 * _parameter_count(model)
    budget = _DENSE_MEMORY_SHARE * _physical_memory()
    if compute == "codes" or (compute == "auto" and dense_bytes > budget):
        codes_bytes = _codes_path_bytes(model)
        too_big = (
            f"float32 weights would take {dense_bytes / 2**30:.1f} GiB, more than "
            f"{_DENSE_MEMORY_SHARE:.0%} of memory"
        )
        # The codes need the compiled products and OpenBLAS (without either the path
        # is mlx's quantized kernels again, or worse); chosen by itself only where the
        # products' fast build runs.
        possible = packed_rows.available() and cpu_blas.available() and device == "cpu"
        wanted = compute == "codes" or (packed_rows.faster_here() and codes_bytes <= budget)
        if possible and wanted:
            weights = f"float32, its layers as {stored} codes"
            note = f"{too_big}; the layers' weights stay as stored" if compute == "auto" else ""
            return ComputePath(device, blas.CHOICE.name, weights, note or blas.CHOICE.note, True)
        note = f"{too_big}; running {stored} weights (slow on CPU)"
        if compute == "codes":
            note = "no compiled products or OpenBLAS here for the codes path; running as stored"
        return ComputePath(device, blas.CHOICE.name, f"as stored ({stored})", note)
    how = "dequantized" if stored.endswith("-bit") else "converted"
    return ComputePath(device, blas.CHOICE.name, f"float32 ({how} from {stored})", blas.CHOICE.note)


def _stored_description(model: nn.Module) -> str:
    bits = sorted({m.bits for _, m in model.named_modules() if isinstance(m, _QUANTIZED)})
    if bits:
        return "/".join(str(b) for b in bits) + "-bit"
    sizes: dict[str, int] = {}
    for _, value in tree_flatten(model.parameters()):
        name = str(value.dtype).split(".")[-1]
        sizes[name] = sizes.get(name, 0) + value.size
    return max(sizes, key=sizes.get)


def _parameter_count(model: nn.Module) -> int:
    total = 0
    for _, module in model.named_modules():
        if isinstance(module, _QUANTIZED):
            total += module.weight.size * 32 // module.bits
        elif not module.children():
            total += sum(v.size for _, v in tree_flatten(module.parameters()))
    return total


def _codes_path_bytes(model: nn.Module) -> int:
    """The weights' bytes on the codes path: the kept layers' codes with float32
    scales and biases, everything else in float32, and the scratch the largest of
    the kept weights is widened into for a product of many rows."""
    kept = cpu_layers.codes_layers(model)
    total, scratch = 4 * _parameter_count(model), 0
    for name, module in model.named_modules():
        if name in kept:
            widened = 4 * module.weight.size * 32 // module.bits
            total += module.weight.nbytes + 4 * 2 * module.scales.size - widened
            if not cpu_layers.embedding_or_head(name, module):  # those are never widened
                scratch = max(scratch, widened)
    return total + scratch


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 * 2**30


def _dense_weight(module: nn.Module, dtype: mx.Dtype) -> mx.array:
    """Dequantized in `dtype` (mlx's dequantize computes in the scales' dtype: in
    float16 a value kept 11 bits, and a float32 weight differed from the stored
    one by up to 1/2048, as `packed_rows`' products read it)."""
    mode = getattr(module, "mode", "affine")
    scales = module.scales
    biases = module.get("biases")
    if mode == "affine" and mx.issubdtype(dtype, mx.floating):
        scales = scales.astype(dtype)
        biases = biases.astype(dtype) if biases is not None else None
    size, bits = module.group_size, module.bits
    global_scale = getattr(module, "global_scale", None)
    if global_scale is not None:  # nvfp4 experts, each with its own (mlx-lm's switch layers)
        experts = [
            mx.dequantize(w, s, None, size, bits, mode=mode, global_scale=g, dtype=dtype)
            for w, s, g in zip(module.weight, scales, global_scale, strict=True)
        ]
        return mx.stack(experts)
    return mx.dequantize(module.weight, scales, biases, size, bits, mode=mode).astype(dtype)


def _dense_layer(module: nn.Module, shape: tuple[int, ...]) -> nn.Module:
    """The dense counterpart of a quantized layer whose weight has `shape`."""
    bias = "bias" in module
    if isinstance(module, QuantizedSwitchLinear):  # a mixture's experts, stacked
        experts, outputs, inputs = shape
        return SwitchLinear(inputs, outputs, experts, bias=bias)
    if isinstance(module, nn.QuantizedEmbedding):
        return nn.Embedding(*shape)
    return nn.Linear(shape[1], shape[0], bias=bias)


def _dequantize(model: nn.Module, dtype: mx.Dtype, codes_only: Collection[str] = ()) -> None:
    """Replace quantized layers by dense ones, and cast everything to `dtype`. The
    layers at the paths `codes_only` stay quantized (their scales and biases cast)."""
    # Codes beside float32 for decode steps; not on the codes path, whose float32
    # layers are the ones it could not keep as codes (and its estimate counts them once).
    keep_codes = dtype == mx.float32 and packed_rows.faster_here() and not codes_only

    def dense(path: str, module: nn.Module) -> nn.Module:
        if not isinstance(module, _QUANTIZED) or path in codes_only:
            return module
        weight = _dense_weight(module, dtype)
        layer = _dense_layer(module, weight.shape)
        layer.weight = weight
        if "bias" in module:
            layer.bias = module.bias.astype(dtype)
        if keep_codes and type(layer) in (nn.Linear, nn.Embedding):
            # for the decode step's one-row products (`packed_rows`)
            layer.packed_weight = packed_rows.of_module(module)
        return layer

    leaves = tree_map_with_path(dense, model.leaf_modules(), is_leaf=nn.Module.is_module)
    model.update_modules(leaves)
    model.update(tree_map_with_path(lambda _p, v: _cast(v, dtype), model.parameters()))


def _cast(value: mx.array, dtype: mx.Dtype) -> mx.array:
    """Floating arrays to `dtype`; a quantized layer's codes as they are."""
    return value.astype(dtype) if mx.issubdtype(value.dtype, mx.floating) else value
