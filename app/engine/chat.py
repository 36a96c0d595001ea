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
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from app.engine import cpu_blas, cpu_threads
from app.engine.cache_keys import describe_cache
from app.engine.errors import UserError
from app.engine.generation import (
    KVSettings,
    PromptProgress,
    SamplingSettings,
    TextDelta,
    TurnFinished,
    TurnStats,
)
from app.engine.known_tokens import boundary_ids, prompt_tokens
from app.engine.kvconvert import quantizer
from app.engine.kvquant import MixedKVCache
from app.engine.kvscheme import SIXTEEN_BIT, KVScheme, scheme_for, usable_format
from app.engine.loading import LoadedModel
from app.engine.prompt_checkpoints import PromptCheckpoint, TemplateFacts
from app.engine.steps import (
    Quantize,
    decode,
    first_call_tokens,
    make_next_token,
    prefill,
    reusable_prefix,
)

if TYPE_CHECKING:
    from app.engine.restore_race import RestoreRace

Message = dict  # {"role": "user" | "assistant" | "system", "content": str}
Event = TextDelta | PromptProgress | TurnFinished


class ContextFull(UserError):
    pass


class UnsupportedKVSettings(UserError):
    pass


@dataclass
class _Turn:
    """What one turn has counted so far; its stats are made from it once, at the end."""

    prompt: list[int]
    started: float
    reused: int = 0
    generated: int = 0
    first_token_at: float | None = None


class ChatSession:
    """Generates replies for one conversation, reusing its KV cache across turns."""

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.cache: list | None = None
        self.tokens: list[int] = []
        self._boundaries = boundary_ids(loaded.tokenizer)
        self.template = TemplateFacts(loaded.tokenizer, self._spell)

    # -- prompt ---------------------------------------------------------------

    def render(
        self,
        messages: Sequence[Message],
        system: str | None = None,
        known: Sequence[int] = (),
        reply_so_far: str = "",
    ) -> list[int]:
        """The token ids of the conversation, ending with the assistant's turn opening
        and `reply_so_far` (a reply being continued: no end of turn after it).

        `known` are tokens the model has already seen (its cache): as many of them as
        spell the start of the conversation's text are kept as they are, and only the
        rest is tokenized (`known_tokens.prompt_tokens`), so that the cache stays usable.
        """
        full = list(messages)
        if system:
            full = [{"role": "system", "content": system}, *full]
        tokenizer = self.loaded.tokenizer
        text = tokenizer.apply_chat_template(full, add_generation_prompt=True, tokenize=False)
        text += reply_so_far
        return prompt_tokens(text, known, self._tokenize, self._spell, self._boundaries)

    def _tokenize(self, text: str) -> list[int]:
        return list(self.loaded.tokenizer.encode(text, add_special_tokens=False))

    def _spell(self, tokens: list[int]) -> str:
        # As written: no clean-up of spaces before punctuation (Llama 3's tokenizer
        # asks for it), which would make a cache's text part from the chat's at " ,".
        return self.loaded.tokenizer.decode(
            tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    # -- cache ----------------------------------------------------------------

    def reset(self) -> None:
        self.cache = None
        self.tokens = []

    def kv_bytes(self) -> int:
        return sum(c.nbytes for c in self.cache) if self.cache else 0

    def kv_scheme(self, kv: KVSettings) -> KVScheme | None:
        """How this model's cache stores its tokens under `kv`: the app's 8-bit or 4-bit
        scheme; for 16 bits the model's own precision (None), except where the model
        computes in float32 (the CPU path). There 16 bits means float16 (`SIXTEEN_BIT`):
        half float32's memory, the bytes a saved cache holds (so a restore converts
        nothing), and decode steps that read half as much."""
        scheme = scheme_for(kv.bits, kv.group_size)
        if scheme is None and self._computes_in_float32():
            return SIXTEEN_BIT
        return scheme

    def _computes_in_float32(self) -> bool:
        return any(s is not None and s.dtype == mx.float32 for s in self.loaded.cache_layer_shapes)

    def cache_usable(self, kv: KVSettings) -> bool:
        """Whether the cache in memory can go on under `kv` (`usable_format`)."""
        if self.cache is None:
            return False
        wanted = self.kv_scheme(kv)
        return all(
            usable_format(layer.scheme.format, wanted)
            for layer in self.cache
            if isinstance(layer, MixedKVCache)
        )

    def _reuse_prefix(self, prompt: list[int], kv: KVSettings) -> int:
        """Trim the cache to what `prompt` shares with it; return the kept token count."""
        if not self.cache_usable(kv):
            self.cache = make_prompt_cache(self.loaded.model)
            self.tokens = []
        self._fit_windows(kv)
        keep = reusable_prefix(self.tokens, prompt)
        excess = len(self.tokens) - keep
        if excess > 0 and trim_prompt_cache(self.cache, excess) != excess:
            self.cache = make_prompt_cache(self.loaded.model)
            self.tokens, keep = [], 0
        del self.tokens[keep:]
        return keep

    def _fit_windows(self, kv: KVSettings) -> None:
        """Each quantized layer of the cache keeps the 16-bit window `kv` asks for."""
        wanted = self.kv_scheme(kv)
        for layer in self.cache:
            # (a float16 layer serving a quantized scheme is converted by the steps)
            if isinstance(layer, MixedKVCache) and layer.scheme.format == wanted.format:
                layer.set_window(wanted.window)

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
        checkpoint: PromptCheckpoint | None = None,
        race: RestoreRace | None = None,
    ) -> Iterator[Event]:
        """Stream a reply to `prompt`; `max_context` caps prompt plus reply below the
        model's own context length (a memory preference). The prefill stops where
        `checkpoint` says, for its `take`, when that is within the prompt's new tokens.
        `race`: a restore of the prompt's first tokens read meanwhile, taken in place
        of the prefill's cache when it is in first (app/engine/restore_race.py)."""
        sampling = sampling or SamplingSettings()
        kv = kv or KVSettings()
        turn = _Turn(prompt, time.perf_counter())
        room = self.check_fits(len(prompt), max_context)
        self._check_kv(kv)
        mx.reset_peak_memory()
        if cpu_blas.available():
            cpu_threads.start_turn()
        if sampling.seed is not None:
            mx.random.seed(sampling.seed)
        turn.reused = self._reuse_prefix(prompt, kv)
        remaining = prompt[turn.reused :]
        quantize = self._quantizer(kv)
        with mx.stream(generation_stream):
            yield PromptProgress(0, len(remaining))
            tail = first_call_tokens(remaining)
            if checkpoint and turn.reused < checkpoint.tokens < len(prompt):
                tail = len(prompt) - checkpoint.tokens  # the generation prompt
            else:
                checkpoint = None
            steps = self._prefill(turn, len(prompt) - tail, quantize, kv, race, should_stop)
            for progress in steps:
                yield progress
                if should_stop():
                    steps.close()
                    yield self._finish(turn, "", "cancelled")
                    return
            if len(remaining) <= tail and should_stop():  # a short prompt has no prefill step
                yield self._finish(turn, "", "cancelled")
                return
            if checkpoint:
                checkpoint.take(self.cache)
            self.tokens = list(prompt)
            next_token = make_next_token(
                self.loaded.model, self.cache, sampling, quantize, self.tokens
            )
            # The CPU path computes a step in the call: hand each token out first.
            tokens = decode(next_token, remaining[-tail:], ahead=not cpu_blas.available())
            text, reason = yield from self._decode(
                turn, tokens, min(sampling.max_tokens, room), should_stop
            )
        yield self._finish(turn, text, reason)

    def _prefill(
        self,
        turn: _Turn,
        end: int,
        quantize: Quantize,
        kv: KVSettings,
        race: RestoreRace | None,
        should_stop: Callable[[], bool],
    ) -> Iterator[PromptProgress]:
        """Prefill the turn's prompt up to token `end` in steps, yielding the progress
        after each (closing it between steps leaves the cache holding whole steps).
        Where `race` has the history restored first, its cache replaces the one being
        prefilled, which goes on from the restore's end."""
        counted_from, total = turn.reused, len(turn.prompt) - turn.reused
        if race is not None:
            race.prefill_starts()
        while turn.reused < end:
            restored = None
            todo = turn.prompt[turn.reused : end]
            for done in prefill(self.loaded.model, self.cache, todo, quantize):
                self.tokens = list(turn.prompt[: turn.reused + done])
                yield PromptProgress(len(self.tokens) - counted_from, total)
                if race is None:
                    continue
                if (restored := race.take(len(self.tokens), should_stop)) is not None:
                    break
            if restored is None:
                break
            self.cache, self.tokens = restored.cache, list(restored.tokens)
            self._fit_windows(kv)
            turn.reused, race = len(self.tokens), None
            yield PromptProgress(turn.reused - counted_from, total)
        if race is not None:  # the prefill has the history, or stopped before it
            race.cancel()

    def _decode(
        self,
        turn: _Turn,
        tokens: Iterator[int],
        limit: int,
        should_stop: Callable[[], bool],
    ) -> Iterator[Event]:
        """Stream text from `tokens` (`steps.decode`) until an end token, `limit` tokens
        or Stop; returns (text, reason)."""
        detokenizer = self.loaded.tokenizer.detokenizer  # a fresh copy
        eos = set(self.loaded.tokenizer.eos_token_ids)
        reason = "length"
        try:
            for token in tokens:
                self.tokens.append(token)
                turn.generated += 1
                if turn.first_token_at is None:
                    turn.first_token_at = time.perf_counter()
                    prefilled = len(turn.prompt) - turn.reused
                    yield PromptProgress(prefilled, prefilled)
                if token in eos:
                    reason = "stop"
                    break
                detokenizer.add_token(token)
                if segment := detokenizer.last_segment:
                    yield TextDelta(segment)
                if turn.generated >= limit:
                    break
                if should_stop():
                    reason = "cancelled"
                    break
        finally:
            # Settles the cache on the last token handed out, however the loop ends
            # (the CPU path feeds a token only when asked for the next one).
            tokens.close()
        detokenizer.finalize()
        if segment := detokenizer.last_segment:
            yield TextDelta(segment)
        return detokenizer.text, reason

    def check_fits(self, prompt_tokens: int, max_context: int | None = None) -> int:
        """Room left for the reply; ContextFull when the prompt alone fills the context."""
        own = self.loaded.context_length
        limit = min(own, max_context or own)
        if prompt_tokens >= limit:
            raise ContextFull(
                f"The conversation ({prompt_tokens:,} tokens) does not fit the context of "
                f"{limit:,} tokens; start a new chat"
                + ("" if limit == own else " or raise the maximum context")
            )
        return limit - prompt_tokens

    def _check_kv(self, kv: KVSettings) -> None:
        if kv.bits is not None and self.loaded.head_dim % kv.group_size:
            raise UnsupportedKVSettings(
                f"KV group size {kv.group_size} does not divide this model's head size "
                f"({self.loaded.head_dim}); choose a smaller group size"
            )

    def _quantizer(self, kv: KVSettings) -> Callable[[list], None]:
        scheme = self.kv_scheme(kv)
        # "Full precision until" is for quantizing: float16 holds from the first token.
        start = 0 if scheme == SIXTEEN_BIT else kv.quantized_kv_start
        return quantizer(scheme, start)

    def _finish(self, turn: _Turn, text: str, reason: str) -> TurnFinished:
        now = time.perf_counter()
        first = turn.first_token_at
        stats = TurnStats(
            prompt_tokens=len(turn.prompt),
            reused_tokens=turn.reused,
            prefilled_tokens=len(turn.prompt) - turn.reused,
            prefill_s=(first or now) - turn.started,
            ttft_s=first - turn.started if first else 0.0,
            generated_tokens=turn.generated,
            decode_s=now - first if first else 0.0,
            kv_bytes=self.kv_bytes(),
            kv_format=self._kv_format(),
            peak_memory_bytes=mx.get_peak_memory(),
            finish_reason=reason,
            compute=self.loaded.compute.describe(),
        )
        return TurnFinished(text, stats)

    def _kv_format(self) -> str:
        return describe_cache(self.cache)
