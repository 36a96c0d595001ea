"""Messages to the HTML subset Qt's text browser shows: Markdown, highlighted code,
collapsible reasoning, and action links (copy, edit, regenerate, branch arrows).

A message is untrusted text (a reply repeats whatever a pasted page told it), so it is
rendered as text: raw HTML comes out escaped, images become plain links, only http(s)
links are made, and nothing from a message can set a style, load a resource or reach the
app's own links. Those are `action:TOKEN:VERB:ID[:EXTRA]` URLs, where TOKEN is the chat
view's secret; a message cannot know it, so it cannot forge Edit or Regenerate.

Layout stays bounded whatever the text: Markdown (markdown-it, linear on pathological
input, unlike Python-Markdown) covers at most a budget of characters, lines and nesting;
the rest is shown as escaped plain text, itself capped, with a note saying so.
"""

from __future__ import annotations

import contextlib
import functools
import html
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from markdown_it import MarkdownIt
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import TextLexer, get_lexer_by_name
from pygments.util import ClassNotFound

_THINK = re.compile(r"<think>(.*?)(?:</think>|\Z)", re.S)


@dataclass(frozen=True)
class ChatColours:
    """The colours the chat's HTML uses, as CSS values; the defaults are the light theme's
    (app/ui/theme.py has both). Hashable: rendered Markdown is cached per colour set."""

    text: str = "#1f1f1f"
    assistant_bg: str = "#ffffff"
    user_bg: str = "#eef3fb"
    code_bg: str = "#f6f8fa"
    muted: str = "#5f6368"  # labels, footers, reasoning: still 4.5:1 on every background
    link: str = "#1a5fb4"
    warning: str = "#a33a3a"  # Stopped, Interrupted, Cut
    code_style: str = "default"  # a Pygments style; every token 4.5:1 on code_bg
    focus: str = "#1a5fb4"  # the focus ring: 3:1 on every background it is drawn on


LIGHT_CHAT = ChatColours()


@functools.lru_cache(maxsize=8)
def _formatter(style: str) -> HtmlFormatter:
    return HtmlFormatter(noclasses=True, nowrap=True, style=style)


# Budgets per message section (reasoning or answer), chosen from measurements on a 2-core
# CPU (docs/reliability.md): within them setHtml + layout stays well under a second.
MARKDOWN_CHARS = 24_000  # rendered as Markdown (six default-length replies) ...
MARKDOWN_LINES = 1_500
MARKDOWN_LEVEL = 16  # ... while block nesting stays below this (8 nested lists, 16 quotes)
TABLE_COLUMNS = 64  # ... and tables are narrower than this
SHOWN_CHARS = 200_000  # the rest as plain text, up to these; beyond, a note
SHOWN_LINES = 4_000
HIGHLIGHT_CHARS = 12_000  # code highlighted per section; the rest is not
# Qt wraps a long unbroken run in quadratic time (a 200 kB "word" takes seconds), so runs
# get a zero-width break opportunity every so many characters.
_LONG_RUN = re.compile(r"(\S{64})(?=\S)")
# Bidirectional overrides and isolates would let a message reorder what the user reads.
_BIDI_CONTROLS = re.compile("[\u202a-\u202e\u2066-\u2069]")
_SAFE_SCHEMES = ("http", "https")


@dataclass
class RenderedMessage:
    id: int
    role: str
    content: str
    state: str = "complete"
    branch: tuple[int, int] | None = None  # (index, count) among siblings, 1-based
    show_thinking: bool = False
    is_last: bool = False
    cut: bool = False  # the reply reached the length limit before it was done
    being_edited: bool = False  # in the message box now (an edit under way)

    @property
    def can_continue(self) -> bool:
        """A last reply that stopped before its end: cut, stopped or interrupted."""
        unfinished = self.cut or self.state in ("cancelled", "interrupted")
        return self.role == "assistant" and self.is_last and unfinished


def reasoning_and_answer(message: RenderedMessage) -> tuple[str | None, str]:
    """A reply's reasoning and answer (`split_thinking`); what the user typed is all
    answer, shown as typed, tags and all: reasoning is the model's own."""
    if message.role == "assistant":
        return split_thinking(message.content)
    return None, message.content


def split_thinking(text: str) -> tuple[str | None, str]:
    """(reasoning, answer) from a reply that may open with <think>…</think>."""
    match = _THINK.search(text)
    if not match:
        return None, text
    return match.group(1).strip(), (text[: match.start()] + text[match.end() :]).strip()


def action_href(token: str, verb: str, message_id: int, extra: str = "") -> str:
    """The URL of one of the app's own links; only a view that knows `token` acts on it."""
    return f"action:{token}:{verb}:{message_id}" + (f":{extra}" if extra else "")


def is_web_url(url: str) -> bool:
    """Whether a link from a message may be offered to the system browser."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return False
    return parts.scheme.lower() in _SAFE_SCHEMES and bool(parts.netloc)


def visible_text(text: str) -> str:
    """Escaped text for HTML, with break opportunities in long runs and no bidi overrides."""
    return html.escape(_LONG_RUN.sub("\\1\u200b", _BIDI_CONTROLS.sub("", text)), quote=False)


# -- Markdown ------------------------------------------------------------------------


def _render_text(self, tokens, idx, options, env) -> str:
    return visible_text(tokens[idx].content)


def _render_code_inline(self, tokens, idx, options, env) -> str:
    return f"<code>{visible_text(tokens[idx].content)}</code>"


def _render_link_open(self, tokens, idx, options, env) -> str:
    # Only the address: a title from the message would become a tooltip it controls.
    return f'<a href="{html.escape(tokens[idx].attrGet("href") or "")}">'


def _render_image(self, tokens, idx, options, env) -> str:
    """An image is never loaded: it becomes a link to its address, named by its alt text."""
    token = tokens[idx]
    alt = self.renderInlineAsText(token.children or [], options, env)
    label = visible_text(f"[image: {alt or 'no description'}]")
    return f'<a href="{html.escape(token.attrGet("src") or "")}">{label}</a>'


def _render_fence(self, tokens, idx, options, env) -> str:
    token = tokens[idx]
    colours: ChatColours = env["colours"]
    language = token.info.split()[0] if token.info.strip() else ""
    number = env["blocks"]
    env["blocks"] += 1
    href = action_href(env["token"], "copy-code", env["message_id"], f"{env['section']}.{number}")
    return (
        f'<table width="100%" cellpadding="6" style="background:{colours.code_bg};'
        f' margin:4px 0"><tr><td><span style="color:{colours.muted}">'
        f"{visible_text(language or 'code')}"
        f'</span> &nbsp; <a href="{href}">Copy</a>'
        # Wrapped: one long line must not widen the whole transcript.
        f'<pre style="margin:2px 0; white-space: pre-wrap">'
        f"{_highlight(language, token.content, env)}</pre>"
        "</td></tr></table>"
    )


def _highlight(language: str, code: str, env: dict) -> str:
    """Highlighted code, while the section's highlighting budget lasts (a span per token
    can make the HTML thirty times the code)."""
    lexer = TextLexer()
    if language and env["highlighted"] + len(code) <= HIGHLIGHT_CHARS:
        with contextlib.suppress(ClassNotFound):
            lexer = get_lexer_by_name(language)
            env["highlighted"] += len(code)
    return highlight(_BIDI_CONTROLS.sub("", code), lexer, _formatter(env["colours"].code_style))


def _new_markdown() -> MarkdownIt:
    # A nesting limit above MARKDOWN_LEVEL: markdown-it drops blocks nested past its limit,
    # so the text is cut to plain before it could get there (see _markdown_extent).
    # `breaks`: a line end in a reply is a line end on screen (poems, addresses, short
    # lines), as in a chat; CommonMark would join the lines into one paragraph.
    options = {"html": False, "xhtmlOut": False, "breaks": True, "maxNesting": MARKDOWN_LEVEL + 8}
    md = MarkdownIt("commonmark", options)
    md.enable(["table", "strikethrough"])
    md.validateLink = is_web_url
    for name, rule in {
        "text": _render_text,
        "code_inline": _render_code_inline,
        "link_open": _render_link_open,
        "image": _render_image,
        "fence": _render_fence,
    }.items():
        md.add_render_rule(name, rule)
    return md


_MARKDOWN = _new_markdown()


def _normalized(text: str) -> str:
    """Line ends as markdown-it counts them, so its line numbers index this text."""
    return text.replace("\r\n", "\n").replace("\r", "\n").replace("\0", "\ufffd")


def _line_start(text: str, line: int) -> int:
    position = 0
    for _ in range(line):
        position = text.find("\n", position) + 1
        if position == 0:
            return len(text)
    return position


def _within(text: str, chars: int, lines: int) -> int:
    """The length of the longest prefix of `text` with at most `chars` characters and
    `lines` lines, ending at a line end where it can."""
    end = min(_line_start(text, lines), chars)
    if end < len(text) and text[end - 1] != "\n":
        end = text.rfind("\n", 0, end) + 1 or end
    return end


def _first_unrenderable_line(tokens) -> int | None:
    """The first source line nested deeper than MARKDOWN_LEVEL, or starting a table wider
    than TABLE_COLUMNS, if any."""
    line = table = cells = 0
    for token in tokens:
        if token.map:
            line = token.map[0]
        if token.level >= MARKDOWN_LEVEL:
            return line
        if token.type == "table_open":
            table = line
        elif token.type == "tr_open":
            cells = 0
        elif token.type in ("th_open", "td_open"):
            cells += 1
            if cells > TABLE_COLUMNS:
                return table
    return None


def _markdown_extent(text: str, env: dict) -> tuple[list, int]:
    """Parsed tokens of the longest prefix of `text` within the budgets, and its length."""
    end = _within(text, MARKDOWN_CHARS, MARKDOWN_LINES)
    while end > 0:
        tokens = _MARKDOWN.parse(text[:end], env)
        line = _first_unrenderable_line(tokens)
        if line is None:
            return tokens, end
        end = min(_line_start(text, line), end - 1)
    return [], 0


def _plain_html(text: str, colours: ChatColours) -> str:
    note = "The rest is shown as plain text: too long, too deeply nested or too wide to format."
    return f'<p style="color:{colours.muted}"><i>{note}</i></p>' + _as_typed(text, "pre", colours)


def typed_html(text: str, colours: ChatColours = LIGHT_CHAT) -> str:
    """What the user typed, as typed: not Markdown (a new user's walk saw their **bold**
    turn bold and the backticks round `code` go), its lines and spaces kept."""
    return _as_typed(_normalized(text), "p", colours)


def _as_typed(text: str, tag: str, colours: ChatColours) -> str:
    """`text` escaped, its spaces and line ends kept, as far as a view can hold (a note
    says how much more there is)."""
    end = _within(text, SHOWN_CHARS, SHOWN_LINES)
    shown = f'<{tag} style="white-space: pre-wrap">{visible_text(text[:end])}</{tag}>'
    if end == len(text):
        return shown
    hidden = len(text) - end
    return shown + (
        f'<p style="color:{colours.muted}"><i>{hidden:,} more characters are not shown here; '
        "Copy gets the whole message.</i></p>"
    )


@functools.lru_cache(maxsize=64)
def markdown_html(
    text: str,
    message_id: int,
    token: str = "",
    section: str = "answer",
    colours: ChatColours = LIGHT_CHAT,
) -> str:
    """Markdown to HTML, with fenced code highlighted and a copy link per block."""
    text = _normalized(text)
    env = {"message_id": message_id, "token": token, "section": section, "colours": colours}
    env |= {"blocks": 0, "highlighted": 0}
    tokens, end = _markdown_extent(text, env)
    rendered = _MARKDOWN.renderer.render(tokens, _MARKDOWN.options, env)
    if end < len(text) and text[end:].strip():
        rendered += _plain_html(text[end:], colours)
    return rendered


def code_blocks(text: str) -> list[str]:
    """The sources of the fenced code blocks markdown_html shows for `text`, in order."""
    tokens, _ = _markdown_extent(_normalized(text), {})
    return [t.content for t in tokens if t.type == "fence"]


# -- messages ------------------------------------------------------------------------


# The block-level ends of a rendered section (a paragraph, a list's last item, a code
# block's <pre> in its table): the streaming mark goes in before them, not after.
_BLOCK_ENDS = re.compile(
    r"(?:\s*</(?:p|li|ul|ol|pre|td|tr|tbody|table|blockquote|div|h[1-6])>)+\s*$"
)


def with_mark(rendered: str, mark: str) -> str:
    """`rendered` with `mark` at the end of its last line of text, inside the blocks
    that close it; the white space between those ends goes (in a <pre> it would be one
    more, empty, line)."""
    ends = _BLOCK_ENDS.search(rendered)
    if ends is None:
        return rendered.rstrip() + mark
    return rendered[: ends.start()] + mark + re.sub(r"\s+", "", ends.group())


def message_html(
    message: RenderedMessage, token: str = "", colours: ChatColours = LIGHT_CHAT
) -> str:
    def link(verb: str, label: str, message_id: int = message.id) -> str:
        return f'<a href="{action_href(token, verb, message_id)}">{label}</a>'

    thinking, answer = reasoning_and_answer(message)
    streaming = message.state == "streaming"
    mark = f'<span style="color:{colours.muted}">▍</span>'  # where the reply goes on
    parts = []
    if message.being_edited:  # which message the box below holds (a new user's walk)
        parts.append(
            f'<p style="color:{colours.warning}"><i>Being edited in the message box below '
            "(Esc leaves it as it is)</i></p>"
        )
    if thinking is not None:
        # Reasoning with no answer yet (still thinking, or stopped there) is shown open.
        show = message.show_thinking or not answer
        toggle = link("think", "Hide" if show else "Show")
        parts.append(f'<p style="color:{colours.muted}"><i>Reasoning</i> — {toggle}</p>')
        if show:
            reasoning = markdown_html(thinking, message.id, token, "think", colours)
            if streaming and not answer and thinking:
                reasoning, mark = with_mark(reasoning, mark), ""
            parts.append(f'<div style="color:{colours.muted}; margin-left:12px">{reasoning}</div>')
    if message.role == "user":
        parts.append(typed_html(answer, colours))
    elif answer:
        shown = markdown_html(answer, message.id, token, "answer", colours)
        parts.append(with_mark(shown, mark) if streaming else shown)
    elif streaming and mark:
        parts.append(f"<p>{mark}</p>")  # nothing yet: the mark alone
    elif not streaming:
        parts.append(markdown_html(answer, message.id, token, "answer", colours))
    if message.state == "cancelled":
        parts.append(f'<p style="color:{colours.warning}"><i>Stopped</i></p>')
    elif message.state == "interrupted":
        parts.append(
            f'<p style="color:{colours.warning}"><i>Interrupted (the app was closed)</i></p>'
        )
    elif message.state == "failed":  # why was said when it failed (status bar, dialog)
        parts.append(f'<p style="color:{colours.warning}"><i>No reply: this turn failed</i></p>')
    elif message.cut:
        parts.append(f'<p style="color:{colours.warning}"><i>Cut at the length limit</i></p>')

    links = [link("copy-msg", "Copy")]
    if message.role == "user":
        links.append(link("edit", "Edit"))
    if message.role == "assistant" and message.is_last and message.state != "streaming":
        links.append(link("regenerate", "Regenerate", 0))
    if message.can_continue:
        links.append(link("continue", "Continue"))
    if message.branch and message.branch[1] > 1:
        index, count = message.branch
        # Arrows as words-sized targets, not 5-pixel glyphs; none past either end (a
        # new-user walk: Next on the last branch went round to the first).
        back = link("branch-prev", "◀ Previous") if index > 1 else "◀ Previous"
        forward = link("branch-next", "Next ▶") if index < count else "Next ▶"
        links.insert(0, f"{back} &nbsp;{index}/{count}&nbsp; {forward}")
    footer = f'<p style="color:{colours.muted}; font-size:small">{" &nbsp; ".join(links)}</p>'

    who = "You" if message.role == "user" else "Assistant"
    background = colours.user_bg if message.role == "user" else colours.assistant_bg
    return (
        f'<a name="m{message.id}"></a><table width="100%" cellpadding="8" '
        f'style="background:{background}; color:{colours.text}; margin-bottom:6px"><tr><td>'
        f"<b>{who}</b>{''.join(parts)}{footer}</td></tr></table>"
    )


START = "Start a conversation by typing below."
# With an empty library nothing can answer: the empty chat says what to do first.
ADD_A_MODEL = "Add a model to start chatting: File → Models… (Ctrl+Shift+M)."


def conversation_html(
    messages: list[RenderedMessage],
    token: str = "",
    colours: ChatColours = LIGHT_CHAT,
    empty: str = START,
) -> str:
    if not messages:
        return (
            f'<p style="color:{colours.muted}; margin-top:40px" align="center">'
            f"{html.escape(empty)}</p>"
        )
    return "".join(message_html(m, token, colours) for m in messages)


def link_style(colours: ChatColours) -> str:
    """The document's default style sheet: links in the theme's link colour."""
    return f"a {{ color: {colours.link}; }}"
