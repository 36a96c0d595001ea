"""Hostile replies rendered in the real chat view (Qt offscreen): no resource is asked for,
no tag from a reply takes effect, nothing is hidden, the transcript after the reply stays
whole, and the work stays bounded however large or deep the reply is."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest
from chat_view_driver import links, shown_text
from hostile_replies import ALL, RAW_HTML, SECRET
from PySide6.QtCore import Qt
from PySide6.QtGui import QTextDocument

from app.ui.chat_view import ChatView
from app.ui.render import MARKDOWN_LEVEL, RenderedMessage, is_web_url, message_html

AFTER = "AFTER-MARK"

# Everything the app itself writes, tags and attributes; a reply can add none of them.
APP_TAGS = {
    "a", "b", "i", "p", "s", "em", "strong", "code", "pre", "div", "span", "blockquote",
    "ul", "ol", "li", "hr", "br", "table", "thead", "tbody", "tr", "th", "td",
    "h1", "h2", "h3", "h4", "h5", "h6",
}  # fmt: skip
APP_ATTRIBUTES = {
    ("a", "href"), ("a", "name"), ("ol", "start"), ("p", "align"), ("table", "width"),
    ("table", "cellpadding"),
    *((tag, "style") for tag in ("p", "div", "span", "pre", "table", "th", "td")),
}  # fmt: skip
APP_STYLE = {
    "color", "background", "background-color", "margin", "margin-left", "margin-bottom",
    "margin-top", "font-size", "font-weight", "font-style", "text-align", "white-space",
    "border",
}  # fmt: skip
MAX_HTML = 2_000_000  # however long the reply (200 kB plain text escaped, plus Markdown)


class _AppHtml(HTMLParser):
    """Collects what a piece of HTML uses: tags, attributes, styles, links, nesting."""

    VOID = frozenset({"br", "hr", "img"})

    def __init__(self) -> None:
        super().__init__()
        self.tags, self.attributes, self.styles, self.hrefs = set(), set(), [], []
        self.depth = self.max_depth = 0

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        for name, value in attrs:
            self.attributes.add((tag, name))
            if name == "style":
                self.styles += [d.strip() for d in (value or "").split(";") if d.strip()]
            if name == "href":
                self.hrefs.append(value)
        if tag not in self.VOID:
            self.depth += 1
            self.max_depth = max(self.max_depth, self.depth)

    def handle_endtag(self, tag):
        if tag not in self.VOID:
            self.depth -= 1


@pytest.fixture
def view(qtbot):
    view = ChatView()
    qtbot.addWidget(view)
    view.resize(800, 600)
    view.show()
    qtbot.waitExposed(view)
    return view


def transcript(reply: str) -> list[RenderedMessage]:
    return [
        RenderedMessage(1, "user", "hi"),
        RenderedMessage(2, "assistant", reply, state="cancelled"),
        RenderedMessage(3, "user", AFTER),
    ]


@pytest.mark.parametrize("name", ALL)
def test_a_hostile_reply_loads_nothing_and_the_transcript_stays_whole(view, name):
    view.show_messages(transcript(ALL[name]))
    view.document().size()  # laid out
    assert view.refused_resources == 0  # nothing was even asked for
    shown = shown_text(view)
    assert AFTER in shown
    found = links(view)
    # The last message still has its own working links, after whatever the reply did.
    assert [link.text for link in found[-2:]] == ["Copy", "Edit"]
    own = {link.href.split(":")[1] for link in found if link.href.startswith("action:")}
    assert len(own) == 1 and own.pop() not in ALL[name]  # one token, not the reply's
    assert all(link.href.startswith("action:") or is_web_url(link.href) for link in found)


@pytest.mark.parametrize("name", ALL)
def test_a_hostile_reply_adds_no_tag_attribute_or_style(name):
    html = message_html(RenderedMessage(2, "assistant", ALL[name]), token="t0k3n")
    page = _AppHtml()
    page.feed(html)
    assert page.tags <= APP_TAGS
    assert page.attributes <= APP_ATTRIBUTES
    properties = {style.split(":")[0].strip() for style in page.styles}
    assert properties <= APP_STYLE
    assert all("url(" not in s for s in page.styles)
    assert {s for s in page.styles if s.startswith("font-size")} <= {"font-size:small"}
    assert all(h.startswith("action:t0k3n:") or is_web_url(h) for h in page.hrefs)
    assert page.max_depth <= MARKDOWN_LEVEL + 8
    assert len(html) <= MAX_HTML


@pytest.mark.parametrize("name", RAW_HTML)
def test_raw_html_in_a_reply_is_shown_as_text(view, name):
    view.show_messages(transcript(RAW_HTML[name]))
    first_tag = re.search(r"<[^>]*>?", RAW_HTML[name]).group(0)
    assert first_tag in shown_text(view)


@pytest.mark.parametrize("name", [n for n in ALL if SECRET in ALL[n]])
def test_a_reply_cannot_hide_text(view, name):
    view.show_messages(transcript(ALL[name]))
    cursor = view.document().find(SECRET)
    assert not cursor.isNull(), "the text is not in the view at all"
    assert cursor.block().isVisible()
    assert view.cursorRect(cursor).height() >= 10  # a line a person can read
    char_format = cursor.charFormat()
    assert char_format.fontPointSize() == 0 or char_format.fontPointSize() >= 6
    if char_format.foreground().style() != Qt.BrushStyle.NoBrush:
        assert char_format.foreground().color().lightness() < 200  # on a white bubble
    assert not set("\u202a\u202b\u202c\u202d\u202e") & set(view.toPlainText())


def test_a_reply_cannot_shrink_or_blank_the_whole_view(view):
    """The reply's text is laid out at the size of ordinary text."""
    view.show_messages(transcript("ordinary words"))
    ordinary = view.cursorRect(view.document().find("ordinary")).height()
    for name in ("zero-size font", "one-pixel font", "huge font tag"):
        view.show_messages(transcript(RAW_HTML[name]))
        shown = view.document().find("font", 0, QTextDocument.FindFlag.FindCaseSensitively)
        assert view.cursorRect(shown).height() == ordinary


@pytest.mark.parametrize(
    "make",
    [
        lambda n: "word " * (n // 5),
        lambda n: "[" * n,
        lambda n: "- a\n" * (n // 4),
        lambda n: ">" * n,
        lambda n: "- " * (n // 2),
        lambda n: "```\n" + "x = 1\n" * (n // 6),
        lambda n: "x\n" * (n // 2),
    ],
    ids=["words", "brackets", "list items", "quotes", "nested lists", "code", "lines"],
)
def test_the_html_stops_growing_with_the_reply(make):
    """Past the budgets, ten times the reply is no more HTML: the rest is not laid out."""
    sizes = []
    for n in (300_000, 3_000_000):
        page = _AppHtml()
        html = message_html(RenderedMessage(2, "assistant", make(n)), token="t")
        page.feed(html)
        assert page.max_depth <= MARKDOWN_LEVEL + 8
        sizes.append(len(html))
    assert sizes[0] <= MAX_HTML
    assert sizes[1] <= sizes[0] * 1.01 + 200
    assert "more characters are not shown" in html


def test_markdown_cut_for_depth_keeps_every_word(view):
    """Text nested past the limit is shown as plain text, not dropped (markdown-it drops
    blocks nested past its own limit)."""
    nested = "\n".join("  " * i + f"- level{i}" for i in range(60))
    view.show_messages(transcript(nested + "\n\nTHE-END"))
    shown = shown_text(view)
    assert all(f"level{i}" in shown for i in range(60))
    assert "THE-END" in shown
    assert "shown as plain text" in shown
