"""The chat engine on the tiny random model: cache reuse, stop, sampling, KV quantization."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache

from app.engine import chat as chat_module
from app.engine import cpu_blas
from app.engine import steps as steps_module
from app.engine.chat import ChatSession, ContextFull
from app.engine.generation import (
    KVSettings,
    PromptProgress,
    SamplingSettings,
    TextDelta,
    TurnFinished,
)
from app.engine.kvquant import MixedKVCache
from app.engine.steps import common_prefix_length, make_next_token


def run(session, messages, **kwargs) -> tuple[TurnFinished, list]:
    events = list(session.reply(messages, **kwargs))
    assert isinstance(events[-1], TurnFinished)
    return events[-1], events


def cache_offset(session) -> int:
    return session.cache[0].offset


GREEDY = SamplingSettings.greedy(12)


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    assert common_prefix_length([], [1]) == 0


def test_reply_streams_text_that_adds_up_to_the_final_text(tiny_model):
    session = ChatSession(tiny_model)
    finished, events = run(session, [{"role": "user", "content": "hello"}], sampling=GREEDY)
    deltas = [e.text for e in events if isinstance(e, TextDelta)]
    assert len(deltas) > 1
    assert "".join(deltas) == finished.text
    assert finished.stats.generated_tokens == 12
    assert finished.stats.finish_reason == "length"
    assert "float32" in finished.stats.compute  # the engine says which path it took


def test_second_turn_prefills_only_new_tokens(tiny_model):
    session = ChatSession(tiny_model)
    messages = [{"role": "user", "content": "hello there"}]
    first, _ = run(session, messages, sampling=GREEDY)
    cached = list(session.tokens)
    assert len(cached) == cache_offset(session) == first.stats.prompt_tokens + 12

    messages += [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "and then?"},
    ]
    second, _ = run(session, messages, sampling=GREEDY)
    # All of turn one is reused, even where the random model's bytes would not
    # re-tokenize the same: the cached tokens are kept as they were.
    prompt = session.render(messages, known=cached)
    assert prompt[: len(cached)] == cached
    assert second.stats.reused_tokens == len(cached)
    assert second.stats.prefilled_tokens == len(prompt) - len(cached)
    # A plain re-tokenization of the same text shares less with the cache.
    assert common_prefix_length(cached, session.render(messages)) < len(cached)


def test_regenerate_reuses_all_but_the_last_prompt_token(tiny_model):
    session = ChatSession(tiny_model)
    messages = [{"role": "user", "content": "tell me"}]
    first, _ = run(session, messages, sampling=GREEDY)
    again, _ = run(session, messages, sampling=GREEDY)
    assert again.stats.reused_tokens == again.stats.prompt_tokens - 1
    assert again.text == first.text  # greedy, and the trimmed cache is right


def test_edit_reuses_the_prefix_before_the_edited_message(tiny_model):
    session = ChatSession(tiny_model)
    history = [
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "first answer"},
    ]
    original = [*history, {"role": "user", "content": "the original"}]
    edited = [*history, {"role": "user", "content": "an edited one"}]
    run(session, original, sampling=GREEDY)
    result, _ = run(session, edited, sampling=GREEDY)
    shared = common_prefix_length(session.render(original), session.render(edited))
    assert shared > len(session.render(history[:1]))
    assert result.stats.reused_tokens == shared
    fresh, _ = run(ChatSession(tiny_model), edited, sampling=GREEDY)
    assert result.text == fresh.text


@pytest.mark.skipif(not cpu_blas.available(), reason="the CPU path's steps")
def test_the_cpu_path_hands_out_the_first_token_before_computing_the_next(tiny_model):
    """A CPU-path step is computed in the call: computing the next token before the
    first was shown made every reply's first token wait a whole decode step."""
    session = ChatSession(tiny_model)
    for event in session.reply([{"role": "user", "content": "go on"}], sampling=GREEDY):
        if isinstance(event, TextDelta):
            # the first generated token is out; the cache holds the prompt alone
            assert cache_offset(session) == len(session.tokens) - 1
            break


@pytest.mark.parametrize("ahead", [True, False], ids=["fed ahead", "fed when asked"])
@pytest.mark.parametrize("taken", [1, 4])
def test_the_cache_holds_every_token_handed_out_wherever_the_caller_stops(tiny_model, ahead, taken):
    model, prompt = tiny_model.model, [5, 6, 7, 8]
    cache = make_prompt_cache(model)
    next_token = make_next_token(model, cache, GREEDY, lambda _: None, list(prompt))
    fed = []

    def counted(inputs: mx.array) -> mx.array:
        fed.append(inputs.size)
        return next_token(inputs)

    tokens = steps_module.decode(counted, prompt, ahead=ahead)
    handed = [next(tokens) for _ in range(taken)]
    # fed when asked, the step after a token runs only once the caller asks for more
    assert len(fed) == taken + (1 if ahead else 0)
    tokens.close()
    assert len(handed) == taken
    assert cache[0].offset == len(prompt) + taken


def test_the_penalty_sees_the_same_tokens_whichever_order_the_steps_run(tiny_model):
    """The repetition penalty reads every token fed, the one just sampled included,
    whether the device computes ahead (a GPU) or each token is handed out first (the
    CPU path): the same settings give the same reply on both."""
    prompt = [5, 6, 7, 8, 5, 6]

    def reply(sampling: SamplingSettings, ahead: bool) -> list[int]:
        cache, history = make_prompt_cache(tiny_model.model), list(prompt)
        next_token = make_next_token(tiny_model.model, cache, sampling, lambda _: None, history)
        tokens = steps_module.decode(next_token, prompt, ahead=ahead)
        for _ in range(24):
            history.append(next(tokens))
        tokens.close()
        return history[len(prompt) :]

    penalized = replace(GREEDY, repetition_penalty=3.0)
    assert reply(penalized, True) == reply(penalized, False)
    assert reply(penalized, True) != reply(GREEDY, True)  # the penalty is at work here


@pytest.mark.skipif(not cpu_blas.available(), reason="the CPU path's steps")
def test_an_error_in_the_reply_loop_leaves_cache_and_tokens_in_step(tiny_model):
    """The CPU path feeds a token when asked for the next one: a reply loop that fails
    (a Stop check raising) still settles the cache on every token handed out."""
    session = ChatSession(tiny_model)
    asked = []

    def failing_stop() -> bool:
        asked.append(1)
        if len(asked) == 3:
            raise RuntimeError("the window went away")
        return False

    with pytest.raises(RuntimeError) as failed:
        for _ in session.reply(
            [{"role": "user", "content": "go on"}],
            sampling=SamplingSettings.greedy(50),
            should_stop=failing_stop,
        ):
            pass
    # (while the error is kept, as a caller's handler keeps it, so are the loop's frames)
    assert failed.traceback and len(session.tokens) == cache_offset(session)


def test_stop_between_tokens_keeps_cache_and_tokens_in_step(tiny_model):
    session = ChatSession(tiny_model)
    seen = []

    def stop_after_three() -> bool:
        return len(seen) >= 3

    for event in session.reply(
        [{"role": "user", "content": "go on"}],
        sampling=SamplingSettings.greedy(50),
        should_stop=stop_after_three,
    ):
        if isinstance(event, TextDelta):
            seen.append(event.text)
        if isinstance(event, TurnFinished):
            finished = event
    assert finished.stats.finish_reason == "cancelled"
    assert finished.stats.generated_tokens < 50
    assert len(session.tokens) == cache_offset(session)


def test_stop_during_prefill(tiny_model, monkeypatch):
    monkeypatch.setattr(steps_module, "PREFILL_STEP", 8)
    session = ChatSession(tiny_model)
    progress = []

    def stop_after_first_step() -> bool:
        return len(progress) >= 2

    for event in session.reply(
        [{"role": "user", "content": "a fairly long message " * 6}],
        sampling=GREEDY,
        should_stop=stop_after_first_step,
    ):
        if isinstance(event, PromptProgress):
            progress.append(event)
        if isinstance(event, TurnFinished):
            finished = event
    assert finished.stats.finish_reason == "cancelled"
    assert finished.stats.generated_tokens == 0
    assert progress[-1].done == 8 < progress[-1].total
    assert len(session.tokens) == cache_offset(session) == 8


def test_prefill_reports_progress_in_steps(tiny_model, monkeypatch):
    monkeypatch.setattr(steps_module, "PREFILL_STEP", 16)
    session = ChatSession(tiny_model)
    _, events = run(session, [{"role": "user", "content": "words " * 20}], sampling=GREEDY)
    progress = [e for e in events if isinstance(e, PromptProgress)]
    total = progress[0].total
    assert [p.done for p in progress] == [0, *range(16, total - 1, 16), total - 1, total]


def test_seeded_sampling_repeats_and_differs_from_greedy(tiny_model):
    hot = SamplingSettings(temperature=1.5, top_p=1.0, max_tokens=20, seed=7)
    messages = [{"role": "user", "content": "hi"}]
    one, _ = run(ChatSession(tiny_model), messages, sampling=hot)
    two, _ = run(ChatSession(tiny_model), messages, sampling=hot)
    greedy, _ = run(ChatSession(tiny_model), messages, sampling=SamplingSettings.greedy(20))
    assert one.text == two.text
    assert one.text != greedy.text


def test_repetition_penalty_changes_the_reply(tiny_model):
    messages = [{"role": "user", "content": "hi"}]
    plain, _ = run(ChatSession(tiny_model), messages, sampling=SamplingSettings.greedy(30))
    penalised = SamplingSettings(temperature=0.0, repetition_penalty=3.0, max_tokens=30, seed=0)
    other, _ = run(ChatSession(tiny_model), messages, sampling=penalised)
    assert other.text != plain.text


def test_system_prompt_goes_first(tiny_model):
    session = ChatSession(tiny_model)
    tokens = session.render([{"role": "user", "content": "hi"}], system="be brief")
    text = tiny_model.tokenizer.decode(tokens)
    assert text.startswith("<|im_start|>system\nbe brief<|im_end|>")


def test_kv_quantization_after_the_start_threshold(tiny_model):
    session = ChatSession(tiny_model)
    kv = KVSettings(bits=8, group_size=32, quantized_kv_start=10_000)
    first, _ = run(session, [{"role": "user", "content": "hi"}], sampling=GREEDY, kv=kv)
    assert isinstance(session.cache[0], KVCache)
    assert first.stats.kv_format == "float32"

    kv = KVSettings(bits=8, group_size=32, quantized_kv_start=0)
    second, _ = run(session, [{"role": "user", "content": "hi"}], sampling=GREEDY, kv=kv)
    assert isinstance(session.cache[0], MixedKVCache)
    assert second.stats.kv_format == "8-bit (group 32, 16-bit first 4 + last 64 tokens)"
    assert second.stats.reused_tokens > 0  # a full-precision cache converts losslessly
    assert 0 < second.stats.kv_bytes < first.stats.kv_bytes


def test_a_quantized_cache_is_not_reused_by_another_format(tiny_model):
    session = ChatSession(tiny_model)
    messages = [{"role": "user", "content": "hi"}]
    run(session, messages, sampling=GREEDY, kv=KVSettings(bits=4, group_size=32))
    full, _ = run(session, messages, sampling=GREEDY, kv=KVSettings())
    assert full.stats.reused_tokens == 0
    assert full.stats.kv_format == "16-bit"  # float16 on the CPU path


def test_kv_settings_are_checked():
    with pytest.raises(ValueError, match="KV bits"):
        KVSettings(bits=5)
    with pytest.raises(ValueError, match="group size"):
        KVSettings(bits=4, group_size=48)


def test_a_conversation_longer_than_the_context_is_refused(tiny_model, monkeypatch):
    session = ChatSession(tiny_model)
    with pytest.raises(ContextFull, match="does not fit the context"):
        list(session.reply([{"role": "user", "content": "x " * 3000}]))


def test_peak_memory_and_kv_bytes_are_reported(tiny_model):
    finished, _ = run(ChatSession(tiny_model), [{"role": "user", "content": "hi"}], sampling=GREEDY)
    assert finished.stats.kv_bytes > 0
    assert finished.stats.peak_memory_bytes >= finished.stats.kv_bytes
    assert mx.get_peak_memory() > 0


def test_a_group_size_that_does_not_fit_the_heads_is_refused(tiny_model):
    session = ChatSession(tiny_model)
    kv = KVSettings(bits=4, group_size=64)  # the tiny model's heads are 32 wide
    with pytest.raises(chat_module.UnsupportedKVSettings, match="head size"):
        list(session.reply([{"role": "user", "content": "hi"}], kv=kv))


def test_a_maximum_context_caps_the_reply_and_refuses_longer_prompts(tiny_model):
    session = ChatSession(tiny_model)
    messages = [{"role": "user", "content": "hello"}]
    prompt_tokens = len(session.render(messages))
    *_, finished = session.reply(
        messages, sampling=SamplingSettings.greedy(50), max_context=prompt_tokens + 5
    )
    assert finished.stats.generated_tokens == 5 and finished.stats.finish_reason == "length"
    with pytest.raises(ContextFull, match="raise the maximum context"):
        list(ChatSession(tiny_model).reply(messages, max_context=prompt_tokens))


class CountingModel:
    """The model, noting how many tokens each call feeds."""

    def __init__(self, model, fed: list[int]) -> None:
        self.model, self.fed = model, fed

    def __call__(self, inputs, *args, **kwargs):
        self.fed.append(inputs.shape[1])
        return self.model(inputs, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def follow_up(session, before_second_turn=lambda: None) -> TurnFinished:
    messages = [{"role": "user", "content": "hello there"}]
    first, _ = run(session, messages, sampling=GREEDY)
    messages += [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "and then?"},
    ]
    before_second_turn()
    return run(session, messages, sampling=GREEDY)[0]


def test_a_short_message_is_one_pass_over_the_weights_before_its_first_token(
    tiny_model, monkeypatch
):
    """A follow-up's new tokens go through the model in the call that gives the first
    token: one pass over the weights, not a prefill pass and then a decode pass. The
    reply is the one the two-pass path gives."""
    fed: list[int] = []
    session = ChatSession(replace(tiny_model, model=CountingModel(tiny_model.model, fed)))
    finished = follow_up(session, before_second_turn=fed.clear)
    new = finished.stats.prefilled_tokens
    assert 1 < new <= steps_module.SHORT_PROMPT
    assert fed == [new] + [1] * finished.stats.generated_tokens

    monkeypatch.setattr(steps_module, "SHORT_PROMPT", 0)  # the two-pass path
    assert follow_up(ChatSession(tiny_model)).text == finished.text


def test_a_long_prompt_is_prefilled_without_logits_then_fed_its_last_token(tiny_model):
    fed: list[int] = []
    counted = replace(tiny_model, model=CountingModel(tiny_model.model, fed))
    assert counted.cache_layer_shapes  # its one-token probe, once per load, not counted
    fed.clear()
    session = ChatSession(counted)
    finished, _ = run(session, [{"role": "user", "content": "words " * 60}], sampling=GREEDY)
    generated = finished.stats.generated_tokens
    assert finished.stats.prefilled_tokens > steps_module.SHORT_PROMPT
    assert sum(fed[:-generated]) == finished.stats.prefilled_tokens
    assert fed[-generated - 1 :] == [1] * (generated + 1)


def test_stop_before_a_short_prompt_is_read_gives_no_reply(tiny_model):
    """A short prompt has no prefill step to stop between: Stop pressed while it is
    read still ends the turn before its first token, cache and tokens in step."""
    session = ChatSession(tiny_model)
    first, _ = run(session, [{"role": "user", "content": "hello there"}], sampling=GREEDY)
    messages = [
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "and then?"},
    ]
    finished, _ = run(session, messages, sampling=GREEDY, should_stop=lambda: True)
    assert finished.stats.finish_reason == "cancelled"
    assert finished.stats.generated_tokens == 0
    assert len(session.tokens) == cache_offset(session)
