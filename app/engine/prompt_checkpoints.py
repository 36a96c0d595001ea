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
decode step, as a short prompt's do. The engine that ran the turn keeps the last one
in memory too: the chat's next turn goes back to it without reading the files.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from mlx_lm.models.cache import make_prompt_cache

from app.engine.snapshots import is_chunkable
from sessions.cachefiles import CacheRejected

if TYPE_CHECKING:
    from app.engine.chat import ChatSession
    from app.engine.checkpoints import Taken
    from app.engine.kvstore import KVStore
    from sessions.cachefiles import ConversationCache

log = logging.getLogger(__name__)

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


class PromptCheckpoints:
    """One engine's checkpoints before generation prompts: whether a turn takes one,
    the one taken in the turn under way (written with its save), and the last saved,
    which the chat's next turn goes back to in memory."""

    def __init__(self, kvstore: KVStore, session: ChatSession) -> None:
        self.kvstore, self.session = kvstore, session
        # Whether every layer of the model's cache can be cut back to any token.
        self._cuts_back = is_chunkable(make_prompt_cache(kvstore.loaded.model))
        self._taken: tuple[int, Taken] | None = None
        self._last: tuple[int, list[int], Taken] | None = None  # with its tokens

    @property
    def needed(self) -> bool:
        """Whether turns take one: the model's cache cannot be cut back and its template
        does not write replies back as they were written."""
        return not self._cuts_back and not self.session.template.writes_replies_back

    def next_turn_start(self, entry: ConversationCache) -> int | None:
        """Where the saved conversation's next turn will go on from, when that is the
        checkpoint before its last generation prompt (the one before its last): a
        prefetch restores that far, not to the end the next prompt parts from."""
        if not self.needed or len(entry.checkpoint_keys) < 2:
            return None
        row = self.kvstore.index.chunk(entry.checkpoint_keys[-2])
        return row["token_end"] if row else None

    def for_turn(self, conversation_id: int, prompt: list[int]) -> PromptCheckpoint | None:
        """Where this turn takes one: before its generation prompt, where `needed`;
        None for the others."""
        self._taken = None
        if not self.needed:
            return None
        end = self.session.template.history_end(prompt)
        if end is None:
            return None
        return PromptCheckpoint(end, lambda cache: self._take(conversation_id, cache, end))

    def _take(self, conversation_id: int, cache: list, tokens: int) -> None:
        """A failure costs the next turn's speed, never this reply."""
        try:
            self._taken = (conversation_id, self.kvstore.take_checkpoint(cache, tokens))
        except Exception:
            log.exception("no checkpoint before the generation prompt")

    def for_save(self, conversation_id: int) -> Taken | None:
        """The checkpoint this turn took, for the save of the session's cache; kept as
        the one the chat's next turn goes back to."""
        pending, self._taken, self._last = self._taken, None, None
        if pending is None or pending[0] != conversation_id:
            return None
        taken = pending[1]
        self._last = (conversation_id, self.session.tokens[: taken.tokens], taken)
        return taken

    def resume(self, conversation_id: int, usable: int) -> bool:
        """Take the session's cache back to the last checkpoint, in memory, when that
        is within the `usable` tokens it shares with the turn's prompt."""
        if self._last is None or self._last[0] != conversation_id:
            return False
        _, tokens, taken = self._last
        if len(tokens) > usable or self.session.tokens[: len(tokens)] != tokens:
            return False
        try:
            cache = self.kvstore.resume(self.session.cache, taken)
        except CacheRejected:
            return False
        except Exception:  # its layers may be cut back by now: the files are the way
            log.exception("no resume in memory")
            self.session.reset()
            return False
        self.session.cache, self.session.tokens = cache, tokens
        return True
