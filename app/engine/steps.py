"""The steps of one turn, as plain functions (mlx-lm keeps `generate_step` apart
from `stream_generate` the same way): which cached tokens a prompt can reuse,
prefill, and decode. `ChatSession` composes them; the benches call them too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from app.engine import last_row
from app.engine.generation import SamplingSettings

# Tokens per prefill step: large enough for fast matmuls, small enough that
# progress and Stop stay responsive.
PREFILL_STEP = 512
# The repetition penalty looks at this many recent tokens (mlx-lm's default is 20).
PENALTY_WINDOW = 64
# A prompt whose uncached part is this short goes through the model in one call, the
# call that gives the reply's first token: a turn on a reused cache is one pass over
# the weights, not a prefill pass and then a decode pass (on the CPU path a pass is
# about 60-85 ms of the starter's; the extra rows' logits cost well under 1 ms each).
# A longer one is prefilled but for its last token, whose call gives the first token,
# so that a long prefill never computes logits for its rows.
SHORT_PROMPT = 64

Quantize = Callable[[list], None]


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def reusable_prefix(cached: Sequence[int], prompt: Sequence[int]) -> int:
    """How many of the `cached` tokens a turn on `prompt` keeps: their common
    prefix, less at least one prompt token, which must be fed for its logits
    to start the reply. The one rule, for memory and for disk."""
    return max(0, min(common_prefix_length(cached, prompt), len(prompt) - 1))


def first_call_tokens(remaining: Sequence[int]) -> int:
    """How many of a turn's uncached prompt tokens the first decode step feeds (the
    rest are prefilled): all of a short prompt, else the last one."""
    return len(remaining) if len(remaining) <= SHORT_PROMPT else 1


def prefill(
    model, cache: list, tokens: Sequence[int], quantize: Quantize, step: int | None = None
) -> Iterator[int]:
    """Feed `tokens` into `cache` in steps; yields how many are in after each step.
    Closing the generator between steps leaves the cache holding whole steps."""
    step = step or PREFILL_STEP
    done = 0
    for start in range(0, len(tokens), step):
        chunk = tokens[start : start + step]
        model(mx.array(chunk)[None], cache=cache)
        quantize(cache)
        mx.eval([c.state for c in cache])
        done += len(chunk)
        yield done


def make_next_token(
    model, cache: list, sampling: SamplingSettings, quantize: Quantize, history: list[int]
) -> Callable[[mx.array], mx.array]:
    """One decode step: feed a token (or the last prompt tokens) and sample the next.
    The repetition penalty reads `history` (the prompt), then each token fed since."""
    sampler = make_sampler(sampling.temperature, sampling.top_p, sampling.min_p)
    last_row.install(model)  # once per model; the rows before the last get no logits
    penalty = sampling.repetition_penalty if sampling.repetition_penalty != 1.0 else None
    processors = make_logits_processors(
        repetition_penalty=penalty, repetition_context_size=PENALTY_WINDOW
    )

    # What the penalty reads: the history, then each token as it is fed (lazily, so a
    # device computing ahead is not waited for, and before the caller has seen it).
    window = mx.array(history[-PENALTY_WINDOW:], mx.int32)
    calls = 0

    def next_token(inputs: mx.array) -> mx.array:
        nonlocal window, calls
        with last_row.only_last_row(model):
            logits = model(inputs[None], cache=cache)[:, -1, :]
        quantize(cache)
        if processors:
            if calls:  # the first call feeds the prompt's last tokens: `history` has them
                fed = inputs.reshape(-1).astype(mx.int32)
                window = mx.concatenate([window, fed])[-PENALTY_WINDOW:]
            for process in processors:
                logits = process(window, logits)
        calls += 1
        return sampler(logits - mx.logsumexp(logits, keepdims=True))

    return next_token


def decode(
    next_token: Callable[[mx.array], mx.array], prompt_tail: Sequence[int], ahead: bool = True
) -> Iterator[int]:
    """Generated token ids, one at a time, for as long as the caller takes them.

    Wherever the caller stops, the cache holds every token it was given. `ahead`:
    each token is fed into the cache (computing the one after it, asynchronously)
    before it is handed out, so that the device computes while the caller handles
    the token. Where a step is computed at once, in the call (the CPU path's numpy
    layers and BLAS products), that would keep each token until the next one was
    computed, a whole step later; there a token is handed out first and fed when the
    caller asks for the next one, or stops.
    """
    y = next_token(mx.array(prompt_tail))  # the last prompt tokens, at least one
    mx.async_eval(y)
    while True:
        if ahead:
            next_y = next_token(y)
            mx.async_eval(next_y)
        token = y.item()
        try:
            yield token
        except GeneratorExit:
            mx.eval(next_y if ahead else next_token(y))  # the cache settles
            raise
        if not ahead:
            next_y = next_token(y)
        y = next_y
