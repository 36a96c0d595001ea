"""A turn's first call projects only its last row onto the vocabulary, and that row's
logits are the ones the whole call gives (`app/engine/last_row.py`)."""

from __future__ import annotations

import families
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from app.engine import last_row
from app.engine.generation import SamplingSettings
from app.engine.loading import load
from app.engine.steps import make_next_token

HISTORY = list(range(300, 340))
MESSAGE = list(range(1000, 1017))  # a short follow-up, fed in one call


def first_call_logits(model, last_only: bool) -> mx.array:
    """The follow-up's logits after the history, in a cache of their own."""
    cache = make_prompt_cache(model)
    model(mx.array(HISTORY)[None], cache=cache)
    if not last_only:
        return model(mx.array(MESSAGE)[None], cache=cache)
    with last_row.only_last_row(model):
        return model(mx.array(MESSAGE)[None], cache=cache)


def assert_last_row_alone(model) -> None:
    assert last_row.install(model)
    every_row = first_call_logits(model, last_only=False)
    last = first_call_logits(model, last_only=True)
    assert every_row.shape[1] == len(MESSAGE)  # outside the context: all rows, as before
    assert last.shape == (1, 1, every_row.shape[-1])
    np.testing.assert_allclose(
        np.array(last[0, 0].astype(mx.float32)),
        np.array(every_row[0, -1].astype(mx.float32)),
        rtol=1e-4,
        atol=1e-4,
    )


def test_the_starter_model_s_first_token_comes_from_its_last_row(starter_model):
    assert_last_row_alone(starter_model.model)


@pytest.mark.parametrize("family", sorted(families.FAMILIES))
def test_every_family_s_first_token_comes_from_its_last_row(family, starter_model_dir, tmp_path):
    assert_last_row_alone(load(families.build(family, starter_model_dir, tmp_path)).model)


def test_a_turn_s_first_token_is_the_whole_call_s(starter_model):
    """The step the engine runs (last row only) picks what the full call's last row
    picks."""
    model = starter_model.model
    greedy = mx.argmax(first_call_logits(model, last_only=False)[0, -1]).item()
    cache = make_prompt_cache(model)
    model(mx.array(HISTORY)[None], cache=cache)
    step = make_next_token(model, cache, SamplingSettings.greedy(1), lambda _: None, [])
    assert step(mx.array(MESSAGE)).item() == greedy


def test_a_model_without_a_known_backbone_is_left_as_it_is():
    model = nn.Linear(4, 4)
    assert not last_row.install(model)
    with last_row.only_last_row(model):
        assert model(mx.zeros((1, 3, 4))).shape == (1, 3, 4)


def test_contexts_nest_and_other_threads_get_every_row(starter_model):
    """Perplexity on another thread, or a context opened inside another, is not cut
    to one row by a turn's context."""
    import threading

    model = starter_model.model
    last_row.install(model)
    tokens = mx.array(MESSAGE)[None]
    seen = []
    with last_row.only_last_row(model):
        with last_row.only_last_row(model):
            pass
        seen.append(model(tokens).shape[1])  # still inside the outer one
        thread = threading.Thread(target=lambda: seen.append(model(tokens).shape[1]))
        thread.start()
        thread.join()
    seen.append(model(tokens).shape[1])
    assert seen == [1, len(MESSAGE), len(MESSAGE)]
