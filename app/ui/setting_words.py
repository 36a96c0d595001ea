"""The sampling settings and the memory saving in plain words: one label and one tooltip
each, for Preferences and for a chat's own settings alike."""

from __future__ import annotations

import html

# field: (label, tooltip, lowest, highest, step); max_tokens is the one whole number.
FIELDS = {
    "temperature": (
        "Temperature",
        "How adventurous the replies are: 0 always picks the likeliest next word (the same "
        "reply every time); higher values give more varied, less predictable replies.",
        0.0,
        2.0,
        0.05,
    ),
    "top_p": (
        "Top-p",
        "Only the likeliest words whose chances add up to this share are considered; "
        "1 considers every word, lower values keep the replies on the likeliest path.",
        0.0,
        1.0,
        0.01,
    ),
    "min_p": (
        "Min-p",
        "Leave out words much less likely than the best one: 0.05 drops every word under "
        "5% of the best word's chance; 0 leaves none out.",
        0.0,
        1.0,
        0.01,
    ),
    "repetition_penalty": (
        "Repetition penalty",
        "Above 1 makes the model less likely to repeat words it already used; 1 is off.",
        0.5,
        2.0,
        0.01,
    ),
    "max_tokens": (
        "Reply length limit (tokens)",
        "The longest a reply may be; a reply cut here is marked and can be continued. "
        "A token is about three quarters of a word.",
        1,
        32768,
        1,
    ),
}
# No figures here: Preferences gives the ones measured (a walk found "about half" here
# beside 59% there).
KV_TIP = (
    "Memory saving for the model's working memory of this chat (its KV cache): 8-bit "
    "takes less memory than full precision, 4-bit less still, at a small cost in quality "
    "(Preferences → Memory gives the figures measured). A cache saved in one setting that "
    "another cannot use is computed again once; nothing is lost."
)


def wrapped(tip: str) -> str:
    """A tooltip that wraps: Qt wraps one of rich text, while a plain one ran off the
    dialog in one line (a new user's walk)."""
    return f"<p>{html.escape(tip)}</p>"
