"""One conversation's generation state: its KV cache and the tokens in it.

The source of truth for the cache is the exact token sequence fed to the
model (`ChatSession.tokens`). Each turn renders the whole conversation with
the model's chat template, keeps the longest common prefix with those tokens,
trims the cache to it and prefills only the rest. Every generated token is fed
into the cache before it is handed out, so a turn stopped at any point leaves
`tokens` and the cache in step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from app.engine.errors import UserError
from app.engine.generation import (
    KVSettings,
    PromptProgress,
    SamplingSettings,
    TextDelta,
    TurnFinished,
    TurnStats,
)
from app.engine.kvquant import MixedKVCache, quantizer
from app.engine.kvscheme import scheme_for
from app.engine.loading import LoadedModel

Message = dict  # {"role": "user" | "assistant" | "system", "content": str}
Event = TextDelta | PromptProgress | TurnFinished

# Tokens per prefill step: large enough for fast matmuls, small enough that
# progress and Stop stay responsive.
PREFILL_STEP = 512
# The repetition penalty looks at this many recent tokens (mlx-lm's default is 20).
_PENALTY_WINDOW = 64


class ContextFull(UserError):
    pass


class UnsupportedKVSettings(UserError):
    pass


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class ChatSession:
    """Generates replies for one conversation, reusing its KV cache across turns."""

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.cache: list | None = None
        self.tokens: list[int] = []

    # -- prompt ---------------------------------------------------------------

    def render(
        self, messages: Sequence[Message], system: str | None = None, known: Sequence[int] = ()
    ) -> list[int]:
        """The token ids of the conversation, ending with the assistant's turn opening.

        `known` are tokens the model has already seen (its cache). When they spell the
        start of the conversation's text they are kept as they are and only the rest is
        tokenized: a reply's own tokens need not survive a decode/encode round trip, so
        the whole cache stays usable.
        """
        full = list(messages)
        if system:
            full = [{"role": "system", "content": system}, *full]
        tokenizer = self.loaded.tokenizer
        text = tokenizer.apply_chat_template(full, add_generation_prompt=True, tokenize=False)
        if known:
            known_text = tokenizer.decode(list(known), skip_special_tokens=False)
            if text.startswith(known_text):
                return [
                    *known,
                    *tokenizer.encode(text[len(known_text) :], add_special_tokens=False),
                ]
        return list(tokenizer.encode(text, add_special_tokens=False))

    # -- cache ----------------------------------------------------------------

    def reset(self) -> None:
        self.cache = None
        self.tokens = []

    def kv_bytes(self) -> int:
        return sum(c.nbytes for c in self.cache) if self.cache else 0

    def _cache_usable(self, kv: KVSettings) -> bool:
        """Whether the cache can go on under `kv`; a quantized cache is never used
        for another scheme (or for full precision), a full-precision one always."""
        if self.cache is None:
            return False
        wanted = scheme_for(kv.bits, kv.group_size)
        for layer in self.cache:
            if isinstance(layer, QuantizedKVCache):  # mlx-lm's: never made by the app now
                return False
            if isinstance(layer, MixedKVCache):
                if wanted is None or layer.scheme.format != wanted.format:
                    return False
                layer.set_window(wanted.window)
        return True

    def _reuse_prefix(self, prompt: list[int], kv: KVSettings) -> int:
        """Trim the cache to what `prompt` shares with it; return the kept token count."""
        if not self._cache_usable(kv):
            self.cache = make_prompt_cache(self.loaded.model)
            self.tokens = []
        # Keep at least one prompt token to feed: its logits start the reply.
        keep = min(common_prefix_length(self.tokens, prompt), len(prompt) - 1)
        excess = len(self.tokens) - keep
        if excess > 0 and trim_prompt_cache(self.cache, excess) != excess:
            self.cache = make_prompt_cache(self.loaded.model)
            self.tokens, keep = [], 0
        del self.tokens[keep:]
        return keep

    # -- generation -----------------------------------------------------------

    def reply(
        self,
        messages: Sequence[Message],
        *,
        system: str | None = None,
        sampling: SamplingSettings | None = None,
        kv: KVSettings | None = None,
        should_stop: Callable[[], bool] = lambda: False,
        max_context: int | None = None,
    ) -> Iterator[Event]:
        """Stream the assistant's reply to `messages` as events, ending with TurnFinished."""
        prompt = self.render(messages, system, known=self.tokens)
        yield from self.generate(
            prompt, sampling=sampling, kv=kv, should_stop=should_stop, max_context=max_context
        )

    def generate(
        self,
        prompt: list[int],
        *,
        sampling: SamplingSettings | None = None,
        kv: KVSettings | None = None,
        should_stop: Callable[[], bool] = lambda: False,
        max_context: int | None = None,
    ) -> Iterator[Event]:
        """Stream a reply to `prompt`; `max_context` caps prompt plus reply below the
        model's own context length (a memory preference)."""
        sampling = sampling or SamplingSettings()
        kv = kv or KVSettings()
        started = time.perf_counter()
        limit = min(self.loaded.context_length, max_context or self.loaded.context_length)
        if len(prompt) >= limit:
            raise ContextFull(
                f"The conversation ({len(prompt)} tokens) no longer fits the context of "
                f"{limit} tokens; start a new chat"
                + ("" if limit == self.loaded.context_length else " or raise the maximum context")
            )
        room = limit - len(prompt)
        if kv.bits is not None and self.loaded.head_dim % kv.group_size:
            raise UnsupportedKVSettings(
                f"KV group size {kv.group_size} does not divide this model's head size "
                f"({self.loaded.head_dim}); choose a smaller group size"
            )
        mx.reset_peak_memory()
        if sampling.seed is not None:
            mx.random.seed(sampling.seed)
        stats = TurnStats(prompt_tokens=len(prompt), compute=self.loaded.compute.describe())
        stats.reused_tokens = self._reuse_prefix(prompt, kv)
        remaining = prompt[stats.reused_tokens :]
        stats.prefilled_tokens = len(remaining)

        quantize = self._quantizer(kv)
        sampler = make_sampler(sampling.temperature, sampling.top_p, sampling.min_p)
        processors = make_logits_processors(
            repetition_penalty=sampling.repetition_penalty
            if sampling.repetition_penalty != 1.0
            else None,
            repetition_context_size=_PENALTY_WINDOW,
        )

        def step(token_ids: list[int] | mx.array) -> mx.array:
            inputs = mx.array(token_ids) if isinstance(token_ids, list) else token_ids
            logits = self.loaded.model(inputs[None], cache=self.cache)[:, -1, :]
            quantize(self.cache)
            if processors:
                history = mx.array(self.tokens[-_PENALTY_WINDOW:])
                for process in processors:
                    logits = process(history, logits)
            return sampler(logits - mx.logsumexp(logits, keepdims=True))

        with mx.stream(generation_stream):
            # Prefill all but the last prompt token in steps.
            yield PromptProgress(0, len(remaining))
            for start in range(0, len(remaining) - 1, PREFILL_STEP):
                chunk = remaining[start : min(start + PREFILL_STEP, len(remaining) - 1)]
                self.loaded.model(mx.array(chunk)[None], cache=self.cache)
                quantize(self.cache)
                mx.eval([c.state for c in self.cache])
                self.tokens.extend(chunk)
                yield PromptProgress(start + len(chunk), len(remaining))
                if should_stop():
                    yield self._finish(stats, "", "cancelled", started)
                    return

            self.tokens.append(remaining[-1])
            y = step(remaining[-1:])
            mx.async_eval(y)
            detokenizer = self.loaded.tokenizer.detokenizer  # a fresh copy
            eos = set(self.loaded.tokenizer.eos_token_ids)
            reason = "length"
            first_token_at = None
            while True:
                next_y = step(y)  # feeds y: the cache holds every token handed out
                mx.async_eval(next_y)
                token = y.item()
                self.tokens.append(token)
                if first_token_at is None:
                    first_token_at = time.perf_counter()
                    stats.ttft_s = first_token_at - started
                    stats.prefill_s = stats.ttft_s
                    yield PromptProgress(len(remaining), len(remaining))
                stats.generated_tokens += 1
                if token in eos:
                    reason = "stop"
                    break
                detokenizer.add_token(token)
                if segment := detokenizer.last_segment:
                    yield TextDelta(segment)
                if stats.generated_tokens >= min(sampling.max_tokens, room):
                    break
                if should_stop():
                    reason = "cancelled"
                    break
                y = next_y
            mx.eval(next_y)  # let the cache settle before measuring it
            detokenizer.finalize()
            if segment := detokenizer.last_segment:
                yield TextDelta(segment)
            stats.decode_s = time.perf_counter() - first_token_at
        yield self._finish(stats, detokenizer.text, reason, started)

    def _quantizer(self, kv: KVSettings) -> Callable[[list], None]:
        return quantizer(scheme_for(kv.bits, kv.group_size), kv.quantized_kv_start)

    def _finish(self, stats: TurnStats, text: str, reason: str, started: float) -> TurnFinished:
        stats.finish_reason = reason
        stats.kv_bytes = self.kv_bytes()
        stats.kv_format = self._kv_format()
        stats.peak_memory_bytes = mx.get_peak_memory()
        if not stats.ttft_s:
            stats.prefill_s = time.perf_counter() - started
        return TurnFinished(text, stats)

    def _kv_format(self) -> str:
        layer = (self.cache or [None])[0]
        if isinstance(layer, MixedKVCache):
            return layer.scheme.describe()
        keys = getattr(layer, "keys", None)
        return str(keys.dtype).split(".")[-1] if keys is not None else "empty"
