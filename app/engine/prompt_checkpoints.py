"""A second checkpoint per turn, before the generation prompt, for the chats that need it.

A cache of sliding windows or recurrent states cannot be cut back: a turn goes on
from the latest checkpoint its prompt still begins with (app/engine/checkpoints.py),
and one is saved at the end of each turn. That one serves the next turn only when
the chat template writes the reply back as the model wrote it. Many do not: gpt-oss's
puts it in a "final" channel, a reasoning model's drops the thinking, and some
generation prompts end in text the history never repeats ("<think>\\n"). The next
prompt then parts from the cache where the reply starts, and without a checkpoint
there the turn reads the whole conversation again.

For those templates a turn also keeps a checkpoint where its messages end and the
generation prompt begins: every later prompt of the branch begins with it, and so
does the same prompt asked again (a regenerate). The prefill stops there for it
(`ChatSession.generate`); the few tokens of the generation prompt go with the first
decode step, as a short prompt's do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

# Replies a template is asked to write back (`TemplateFacts.writes_replies_back`).
PROBE_REPLIES = ("Fine, thanks.", "<think>\nA greeting.\n</think>\n\nFine, thanks.")
_ASKED = [{"role": "user", "content": "Hello?"}]
# The most tokens a generation prompt is looked for in (`history_end`).
_OPENING_TOKENS = 32


@dataclass(frozen=True)
class PromptCheckpoint:
    """Hand the turn's cache to `take` when it holds the prompt's first `tokens`."""

    tokens: int
    take: Callable[[list], None]


class TemplateFacts:
    """What a model's chat template does, found once per loaded model."""

    def __init__(self, tokenizer: object, spell: Callable[[list[int]], str]) -> None:
        self._template = tokenizer.apply_chat_template
        self._spell = spell

    @cached_property
    def writes_replies_back(self) -> bool:
        """Whether an earlier reply is written back as the model wrote it, after the
        generation prompt it answered, so that a turn goes on from the end of the
        last one. Asked with a plain reply and a reasoning one."""
        opening = self._text(_ASKED, True)
        if opening is None:
            return False
        for reply in PROBE_REPLIES:
            later = [*_ASKED, {"role": "assistant", "content": reply}, _ASKED[0]]
            text = self._text(later, True)
            if text is None or not text.startswith(opening + reply):
                return False
        return True

    @cached_property
    def generation_prompt(self) -> str | None:
        """The text the template adds to open the assistant's turn ("<|im_start|>
        assistant\\n"); None where it is not a plain addition to the messages."""
        messages, opened = self._text(_ASKED, False), self._text(_ASKED, True)
        if messages is None or opened is None or not opened.startswith(messages):
            return None
        return opened[len(messages) :] or None

    def history_end(self, prompt: list[int]) -> int | None:
        """Where `prompt`'s messages end and its generation prompt begins, in tokens;
        None where its last tokens do not spell the generation prompt."""
        opening = self.generation_prompt
        if opening is None:
            return None
        for n in range(len(prompt) - 1, max(0, len(prompt) - _OPENING_TOKENS) - 1, -1):
            if self._spell(prompt[n:]) == opening:
                return n
        return None

    def _text(self, messages: list[dict], opened: bool) -> str | None:
        try:
            return self._template(messages, add_generation_prompt=opened, tokenize=False)
        except Exception:  # a template's own error (jinja2 raises its kinds)
            return None
