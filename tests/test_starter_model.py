"""The imported starter model (SmolLM2-135M-Instruct) behaves like the real thing."""

from __future__ import annotations

import collections
import random
from dataclasses import replace
from pathlib import Path

from app.engine.chat import ChatSession
from app.engine.evaluate import perplexity
from app.engine.generation import SamplingSettings, TextDelta, TurnFinished
from app.engine.steps import common_prefix_length
from app.service.preferences import Preferences

TEXT = Path(__file__).parents[1] / "resources/text/ordinary-english.txt"
GREEDY = SamplingSettings.greedy(48)


def reply(session, messages, **kwargs) -> TurnFinished:
    *_, finished = session.reply(messages, sampling=kwargs.pop("sampling", GREEDY), **kwargs)
    return finished


def test_greedy_answer_names_paris(starter_model):
    finished = reply(
        ChatSession(starter_model), [{"role": "user", "content": "What is the capital of France?"}]
    )
    assert "Paris" in finished.text
    assert finished.stats.finish_reason == "stop"


def repeats(text: str, words: int = 8) -> int:
    """How often the reply's most repeated run of `words` words occurs in it."""
    split = text.split()
    runs = collections.Counter(tuple(split[i : i + words]) for i in range(len(split) - words + 1))
    return max(runs.values(), default=0)


def test_a_poem_ends_instead_of_looping_with_the_default_settings(starter_model):
    """A new user's first request: with the penalty off, the greedy poem repeats one line
    of eight words 14 times and runs to the limit."""
    sampling = replace(Preferences().turn_options().sampling, temperature=0.0, max_tokens=300)
    finished = reply(
        ChatSession(starter_model),
        [{"role": "user", "content": "Write a short poem about the sea."}],
        sampling=sampling,
    )
    assert finished.stats.finish_reason == "stop" and repeats(finished.text) < 3, finished.text


def test_perplexity_on_ordinary_english_is_that_of_a_working_model(starter_model):
    words = TEXT.read_text().split()
    tokens = starter_model.tokenizer.encode(" ".join(words), add_special_tokens=False)
    shuffled_words = list(words)
    random.Random(0).shuffle(shuffled_words)
    shuffled = starter_model.tokenizer.encode(" ".join(shuffled_words), add_special_tokens=False)

    ppl = perplexity(starter_model, tokens)
    # SmolLM2-135M reads plain prose at a perplexity in the low tens; a wrong
    # rotary layout or tokenizer puts it in the hundreds or thousands.
    assert ppl < 40
    # The same words in random order are far less likely: the measure discriminates.
    assert perplexity(starter_model, shuffled) > 5 * ppl


def test_second_turn_prefills_only_its_new_tokens(starter_model):
    session = ChatSession(starter_model)
    messages = [{"role": "user", "content": "Name a fruit that is yellow."}]
    first = reply(session, messages)
    cached = list(session.tokens)
    messages += [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "And one that is red?"},
    ]
    second = reply(session, messages)
    prompt = session.render(messages)
    # Everything turn one fed the model (its prompt and its whole reply) is reused.
    assert second.stats.reused_tokens == len(cached) == common_prefix_length(cached, prompt)
    assert second.stats.prefilled_tokens == len(prompt) - len(cached)


def test_a_stopped_reply_continues_like_a_fresh_computation(starter_model):
    session = ChatSession(starter_model)
    messages = [{"role": "user", "content": "Write three sentences about the sea."}]
    deltas = []
    for event in session.reply(messages, sampling=GREEDY, should_stop=lambda: len(deltas) >= 6):
        if isinstance(event, TextDelta):
            deltas.append(event.text)
        elif isinstance(event, TurnFinished):
            stopped = event
    assert stopped.stats.finish_reason == "cancelled"
    assert len(session.tokens) == session.cache[0].offset

    messages += [
        {"role": "assistant", "content": stopped.text},
        {"role": "user", "content": "Now one about the mountains."},
    ]
    continued = reply(session, messages)
    assert continued.stats.reused_tokens >= len(session.render(messages[:1]))
    fresh = reply(ChatSession(starter_model), messages)
    assert continued.text == fresh.text
    assert continued.stats.prefilled_tokens < fresh.stats.prefilled_tokens


def test_the_cpu_path_is_reported(starter_model):
    finished = reply(
        ChatSession(starter_model),
        [{"role": "user", "content": "Hi"}],
        sampling=SamplingSettings.greedy(4),
    )
    assert finished.stats.compute.startswith("cpu, float32 (dequantized from 4/8-bit)")
