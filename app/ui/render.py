"""Messages to the HTML subset Qt's text browser shows: Markdown, highlighted code,
collapsible reasoning, and action links (copy, edit, regenerate, branch arrows).

Action links are `action:VERB:ARG` URLs that the chat view handles.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass

import markdown
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import TextLexer, get_lexer_by_name
from pygments.util import ClassNotFound

_FENCE = re.compile(r"```([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)
_THINK = re.compile(r"<think>(.*?)(?:</think>|\Z)", re.S)
_FORMATTER = HtmlFormatter(noclasses=True, nowrap=True, style="friendly")

USER_BG = "#eef3fb"
CODE_BG = "#f6f8fa"


@dataclass
class RenderedMessage:
    id: int
    role: str
    content: str
    state: str = "complete"
    branch: tuple[int, int] | None = None  # (index, count) among siblings, 1-based
    show_thinking: bool = False
    is_last: bool = False


def split_thinking(text: str) -> tuple[str | None, str]:
    """(reasoning, answer) from a reply that may open with <think>…</think>."""
    match = _THINK.search(text)
    if not match:
        return None, text
    return match.group(1).strip(), (text[: match.start()] + text[match.end() :]).strip()


def code_blocks(text: str) -> list[str]:
    return [m.group(2) for m in _FENCE.finditer(text)]


def _highlight(language: str, code: str) -> str:
    try:
        lexer = get_lexer_by_name(language) if language else TextLexer()
    except ClassNotFound:
        lexer = TextLexer()
    return highlight(code, lexer, _FORMATTER)


def markdown_html(text: str, message_id: int) -> str:
    """Markdown to HTML, with fenced code highlighted and a copy link per block."""
    blocks: list[str] = []

    def stash(match: re.Match) -> str:
        n = len(blocks)
        language, code = match.group(1), match.group(2)
        label = html.escape(language or "code")
        blocks.append(
            f'<table width="100%" cellpadding="6" style="background:{CODE_BG};'
            f' margin:4px 0"><tr><td><span style="color:#888">{label}</span>'
            f' &nbsp; <a href="action:copy-code:{message_id}:{n}">Copy</a>'
            f'<pre style="margin:2px 0">{_highlight(language, code)}</pre></td></tr></table>'
        )
        return f"\n\nREPRISECODEBLOCK{n}\n\n"

    body = _FENCE.sub(stash, text)
    rendered = markdown.markdown(body, extensions=["tables", "sane_lists"])
    for n, block in enumerate(blocks):
        rendered = rendered.replace(f"<p>REPRISECODEBLOCK{n}</p>", block)
    return rendered


def message_html(message: RenderedMessage) -> str:
    thinking, answer = split_thinking(message.content)
    parts = []
    if thinking is not None:
        # Reasoning with no answer yet (still thinking, or stopped there) is shown open.
        show = message.show_thinking or not answer
        verb = "Hide" if show else "Show"
        parts.append(
            f'<p style="color:#777"><i>Reasoning</i> — '
            f'<a href="action:think:{message.id}">{verb}</a></p>'
        )
        if show:
            parts.append(
                f'<div style="color:#777; margin-left:12px">'
                f"{markdown_html(thinking, message.id)}</div>"
            )
    if answer or message.state != "streaming":
        parts.append(markdown_html(answer, message.id))
    if message.state == "streaming":
        parts.append('<p style="color:#999">▍</p>')
    elif message.state == "cancelled":
        parts.append('<p style="color:#a66"><i>Stopped</i></p>')

    links = [f'<a href="action:copy-msg:{message.id}">Copy</a>']
    if message.role == "user":
        links.append(f'<a href="action:edit:{message.id}">Edit</a>')
    if message.role == "assistant" and message.is_last and message.state != "streaming":
        links.append('<a href="action:regenerate:0">Regenerate</a>')
    if message.branch and message.branch[1] > 1:
        index, count = message.branch
        links.insert(
            0,
            f'<a href="action:branch-prev:{message.id}">‹</a> {index}/{count} '
            f'<a href="action:branch-next:{message.id}">›</a>',
        )
    footer = f'<p style="color:#888; font-size:small">{" &nbsp; ".join(links)}</p>'

    who = "You" if message.role == "user" else "Assistant"
    background = USER_BG if message.role == "user" else "#ffffff"
    return (
        f'<a name="m{message.id}"></a><table width="100%" cellpadding="8" '
        f'style="background:{background}; margin-bottom:6px"><tr><td>'
        f"<b>{who}</b>{''.join(parts)}{footer}</td></tr></table>"
    )


def conversation_html(messages: list[RenderedMessage]) -> str:
    if not messages:
        return (
            '<p style="color:#888; margin-top:40px" align="center">'
            "Start a conversation by typing below.</p>"
        )
    return "".join(message_html(m) for m in messages)
