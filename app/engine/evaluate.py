"""Quality measures of a loaded model: perplexity over a text."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from app.engine.loading import LoadedModel


def perplexity(loaded: LoadedModel, tokens: list[int], step: int = 512) -> float:
    """exp(mean negative log-likelihood) of each token given the ones before it."""
    if len(tokens) < 2:
        raise ValueError("perplexity needs at least two tokens")
    cache = make_prompt_cache(loaded.model)
    total, count = 0.0, 0
    for start in range(0, len(tokens) - 1, step):
        inputs = mx.array(tokens[start : start + step])
        targets = mx.array(tokens[start + 1 : start + step + 1])
        logits = loaded.model(inputs[None], cache=cache)[0, : len(targets)]
        loss = nn.losses.cross_entropy(logits.astype(mx.float32), targets, reduction="sum")
        total += loss.item()
        count += len(targets)
    return math.exp(total / count)
