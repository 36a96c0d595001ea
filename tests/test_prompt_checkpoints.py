"""What a chat template does to an earlier reply, found once per model: whether a turn
of a model whose cache cannot be cut back needs a checkpoint before its generation
prompt, and where that is."""

from __future__ import annotations

import json
import shutil

import pytest
from mlx_lm.utils import load_tokenizer

from app.engine.prompt_checkpoints import TemplateFacts

# Qwen3-Thinking's way, shortened: the generation prompt opens the thinking, and an
# earlier reply is written back without it.
THINKING = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{{ m['content'].split('</think>')[-1].lstrip('\\n') }}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
BROKEN = "{{ raise_exception('Conversation roles must alternate') }}"


def tokenizer_with(template: str | None, starter_model_dir, tmp_path):
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(starter_model_dir / name, folder / name)
    if template is not None:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["chat_template"] = template
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return load_tokenizer(folder)


def facts_of(tokenizer) -> TemplateFacts:
    return TemplateFacts(tokenizer, lambda ids: tokenizer.decode(ids, skip_special_tokens=False))


def test_a_template_that_writes_replies_back_needs_no_second_checkpoint(
    starter_model_dir, tmp_path
):
    facts = facts_of(tokenizer_with(None, starter_model_dir, tmp_path))  # SmolLM2's ChatML
    assert facts.writes_replies_back
    assert facts.generation_prompt == "<|im_start|>assistant\n"


def test_a_thinking_template_checkpoints_where_every_later_prompt_still_agrees(
    starter_model_dir, tmp_path
):
    tokenizer = tokenizer_with(THINKING, starter_model_dir, tmp_path)
    facts = facts_of(tokenizer)
    assert not facts.writes_replies_back
    assert facts.generation_prompt == "<|im_start|>assistant\n<think>\n"

    asked = [{"role": "user", "content": "Why is the sky blue?"}]
    prompt = tokenizer.apply_chat_template(asked, add_generation_prompt=True)
    end = facts.history_end(prompt)
    assert tokenizer.decode(prompt[:end]).endswith("Why is the sky blue?<|im_end|>\n")
    # The next turn's prompt, with the reply written back without its thinking, and the
    # same prompt asked again, both begin with the tokens before `end`, not after it.
    reply = "<think>\nRayleigh.\n</think>\n\nScattering."
    later = [*asked, {"role": "assistant", "content": reply}, {"role": "user", "content": "And?"}]
    for next_prompt in (tokenizer.apply_chat_template(later, add_generation_prompt=True), prompt):
        assert next_prompt[:end] == prompt[:end]
    following = tokenizer.apply_chat_template(later, add_generation_prompt=True)
    assert following[: len(prompt)] != prompt  # the end of the prompt would not do


@pytest.mark.parametrize("template", [BROKEN, "{{ messages[0]['content'] }}"])
def test_a_template_that_fails_or_writes_no_opening_is_asked_for_nothing(
    template, starter_model_dir, tmp_path
):
    tokenizer = tokenizer_with(template, starter_model_dir, tmp_path)
    facts = facts_of(tokenizer)
    assert not facts.writes_replies_back
    assert facts.generation_prompt is None
    assert facts.history_end(tokenizer.encode("Hello?")) is None
