"""A turn's prompt keeps the tokens the model has seen as far as their text goes, also
where a reply's tokens do not survive a decode/encode round trip and a later message
changed: an edit then resumes from the cache, not from nothing."""

from __future__ import annotations

import pytest
from test_families import assert_identical

from app.bench import shapes
from app.engine.chat import ChatSession
from app.engine.conversation import ConversationEngine, ReplyFinished, TurnOptions
from app.engine.generation import KVSettings, SamplingSettings
from app.engine.known_tokens import longest_spelled_prefix
from app.engine.steps import common_prefix_length
from sessions.db import open_db

REPLY = "Hello there, my friend. The lighthouse keeper's cat 🐈 sleeps."


def spelled_letter_by_letter(tokenizer, text: str) -> list[int]:
    """`text` in tokens no tokenizer would choose (a sampler may write them so)."""
    return [t for letter in text for t in tokenizer.encode(letter, add_special_tokens=False)]


def test_an_edit_after_a_reply_that_does_not_round_trip_keeps_that_reply(starter_model):
    session, tokenizer = ChatSession(starter_model), starter_model.tokenizer
    asked = [{"role": "user", "content": "Tell me about the lighthouse."}]
    first_prompt = session.render(asked)
    reply = spelled_letter_by_letter(tokenizer, REPLY)
    known = [*first_prompt, *reply, tokenizer.eos_token_id]
    then = [*asked, {"role": "assistant", "content": REPLY}]
    known = session.render([*then, {"role": "user", "content": "And the cat?"}], known=known)

    edited = [*then, {"role": "user", "content": "And the keeper?"}]
    prompt = session.render(edited, known=known)
    text = tokenizer.apply_chat_template(edited, add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(prompt) == text  # the same conversation, word for word
    # Everything before the edited message's words is kept, the odd reply included.
    kept = common_prefix_length(prompt, known)
    assert kept > len(first_prompt) + len(reply) + 1
    assert tokenizer.decode(known[:kept]).endswith("<|im_start|>user\nAnd the")
    # A fresh encoding would part from the cache where the reply starts.
    plain = tokenizer.encode(text, add_special_tokens=False)
    assert common_prefix_length(plain, known) <= len(first_prompt)


@pytest.mark.parametrize("cut", [5, 17, 40, 60])
def test_the_longest_spelled_prefix_is_found_through_characters_split_in_bytes(starter_model, cut):
    tokenizer = starter_model.tokenizer
    text = "Cats 🐈🐈‍⬛ and lighthouses 灯台 at dusk, über alles " * 3
    known = tokenizer.encode(text[:cut] + " and then something else entirely")

    def decode(tokens):
        return tokenizer.decode(tokens)

    truth = max(n for n in range(len(known) + 1) if text.startswith(decode(known[:n])))
    found = longest_spelled_prefix(text, known, decode)
    assert text.startswith(decode(known[:found]))
    assert found == truth


@pytest.fixture(scope="module")
def random_sliding_model(starter_model_dir, tmp_path_factory):
    """A sliding-window model of random weights: its replies are runs of bare words
    ("catdog"), which encode again as other tokens."""
    from app.engine.loading import load

    out = tmp_path_factory.mktemp("random-sliding")
    return load(shapes.model_folder("tiny-sliding", starter_model_dir, out))


@pytest.mark.parametrize("bits", [None, 4])
def test_an_edit_on_a_sliding_model_resumes_from_its_checkpoint_and_reopens_as_live(
    random_sliding_model, bits
):
    options = TurnOptions(sampling=SamplingSettings.greedy(40), kv=KVSettings(bits, 32))
    engine = ConversationEngine(open_db(), random_sliding_model, chunk_tokens=64)
    conversation = engine.store.create("m")

    def finished(events) -> ReplyFinished:
        return next(e for e in list(events) if isinstance(e, ReplyFinished))

    list(engine.send(conversation.id, "Tell me a story about a lighthouse.", options))
    end_of_first = len(engine.session.tokens)
    second = finished(engine.send(conversation.id, "And then?", options))
    asked = engine.store.message(second.message_id).parent_id
    edited = finished(engine.edit(asked, "And after that?", options))
    # The first reply's tokens are kept: the edit starts from the checkpoint after it.
    assert (edited.restore.source, edited.restore.checkpoint) == ("disk", 1)
    assert edited.stats.reused_tokens == end_of_first

    reopened = ConversationEngine(open_db(), random_sliding_model, chunk_tokens=64)
    assert reopened.prefetch(conversation.id, options.kv).source == "disk"
    assert_identical(reopened.session.cache, engine.session.cache)
