"""The chat view's links and resources, clicked as a user would (Qt offscreen): the app's
own links work, a reply cannot forge them, a reply's web link opens in the system browser
only on a click, and no image or file is ever loaded, even if HTML got into the view."""

from __future__ import annotations

import pytest
from chat_view_driver import click_at, click_text, links, shown_text
from hostile_replies import DATA_PNG, MARKDOWN, png
from PySide6.QtCore import QObject, QUrl, Slot
from PySide6.QtGui import QDesktopServices, QGuiApplication
from PySide6.QtWidgets import QTextBrowser

from app.ui.chat_view import ChatView
from app.ui.render import RenderedMessage

SCHEMES = ("http", "https", "file", "qrc", "data", "javascript", "action", "mailto")


class Browser(QObject):
    """Stands where the system browser is: QDesktopServices hands it what it would open."""

    def __init__(self) -> None:
        super().__init__()
        self.opened: list[str] = []

    @Slot(QUrl)
    def open(self, url: QUrl) -> None:
        self.opened.append(url.toString())


@pytest.fixture
def browser():
    browser = Browser()
    for scheme in SCHEMES:
        QDesktopServices.setUrlHandler(scheme, browser, "open")
    yield browser
    for scheme in SCHEMES:
        QDesktopServices.unsetUrlHandler(scheme)


@pytest.fixture
def view(qtbot):
    view = ChatView()
    qtbot.addWidget(view)
    view.resize(800, 600)
    view.show()
    qtbot.waitExposed(view)
    return view


@pytest.fixture
def actions(view):
    fired: list[tuple[str, int]] = []
    view.action.connect(lambda verb, message_id: fired.append((verb, message_id)))
    return fired


def chat(reply: str) -> list[RenderedMessage]:
    return [
        RenderedMessage(1, "user", "hello"),
        RenderedMessage(2, "assistant", reply, is_last=True),
    ]


def test_the_apps_own_links_work(qtbot, view, actions):
    view.show_messages(chat("A reply."))
    click_text(qtbot, view, "Edit")
    click_text(qtbot, view, "Regenerate")
    assert actions == [("edit", 1), ("regenerate", 0)]


def test_a_reply_cannot_forge_the_apps_links(qtbot, view, actions, browser):
    clipboard = QGuiApplication.clipboard()
    clipboard.setText("untouched")
    forged = MARKDOWN["forged actions"] + "\n\n" + MARKDOWN["forged token guess"]
    forged += '\n\n<a href="action:edit:1">Edit</a>'
    view.show_messages([RenderedMessage(2, "assistant", forged)])
    # Every "Edit" / "Regenerate" / "Copy" the reply wrote, clicked (its own come first).
    for word, count in (("Edit", 3), ("Regenerate", 1), ("Copy", 1)):
        for occurrence in range(count):
            click_text(qtbot, view, word, occurrence)
    assert actions == [] and browser.opened == []
    assert clipboard.text() == "untouched"
    # A link that does get into the view without the token does nothing either.
    for url in ("action:edit:1", "action:0123:edit:1", "action:regenerate:0", "file:///etc/passwd"):
        view.anchorClicked.emit(QUrl(url))
    assert actions == [] and browser.opened == []


def test_a_web_link_opens_in_the_browser_on_a_click_only(qtbot, view, browser):
    view.show_messages(chat("See [the docs](https://example.org/docs) or [this](file:///etc/x)."))
    assert browser.opened == []  # shown, not followed
    web = next(link for link in links(view) if link.text == "the docs")
    click_at(qtbot, view, web.position)
    assert browser.opened == ["https://example.org/docs"]
    click_text(qtbot, view, "this")  # a file link is not made a link at all
    assert browser.opened == ["https://example.org/docs"]
    assert view.source().isEmpty()  # the view itself never navigated
    assert "the docs" in shown_text(view)


def test_an_image_in_a_reply_is_a_link_never_a_load(qtbot, view, browser):
    view.show_messages(chat("![a pixel](https://tracker.example/p.png)"))
    assert view.refused_resources == 0
    click_text(qtbot, view, "[image: a pixel]")
    assert browser.opened == ["https://tracker.example/p.png"]


@pytest.mark.parametrize("kind", ["file url", "path", "data url"])
def test_the_view_loads_no_image_even_from_html_it_is_given(qtbot, view, tmp_path, kind):
    """loadResource refuses: a 300 px image that a plain QTextBrowser shows stays unloaded."""
    image = tmp_path / "red.png"
    image.write_bytes(png(300))
    source = {"file url": image.as_uri(), "path": str(image), "data url": DATA_PNG}[kind]
    page = f'<p>above</p><img src="{source}"><p>below</p>'
    plain = QTextBrowser()
    qtbot.addWidget(plain)
    plain.resize(800, 600)
    plain.show()
    plain.setHtml(page)
    view.setHtml(page)
    assert plain.document().size().height() > 300  # what would have happened
    assert view.document().size().height() < 100
    assert view.refused_resources == 1


def test_copy_takes_the_code_block_that_was_clicked(qtbot, view):
    reply = (
        "<think>Try this:\n```python\nthought = 1\n```\n</think>"
        "First:\n```python\nfirst = 1\n```\nSecond:\n```sh\necho second\n```"
    )
    view.show_messages(chat(reply))
    click_text(qtbot, view, "Show")  # open the reasoning: its block comes first on screen
    # The user's message has the first Copy; then the reply's blocks, in order.
    copies = [link for link in links(view) if link.text == "Copy"][1:]
    clipboard = QGuiApplication.clipboard()
    copied = []
    for link in copies[:3]:
        click_at(qtbot, view, link.position)
        copied.append(clipboard.text())
    assert copied == ["thought = 1\n", "first = 1\n", "echo second\n"]


def test_an_open_fence_while_streaming_swallows_nothing_after_it(qtbot, view, actions):
    view.show_messages([RenderedMessage(1, "user", "write code")])
    view.append_streaming(RenderedMessage(-2, "assistant", "", state="streaming"))
    view.add_text("Here:\n```python\nprint(1)\n")
    qtbot.waitUntil(lambda: "print(1)" in shown_text(view))
    assert "▍" in shown_text(view)  # the streaming mark still comes after the open block
    view.add_text("```\nAnd that is all.")
    qtbot.waitUntil(lambda: "And that is all." in shown_text(view))
    assert "```" not in shown_text(view)
    finished = view.messages[-1].content  # stored, then shown as the window does
    view.show_messages(
        [
            RenderedMessage(1, "user", "write code"),
            RenderedMessage(2, "assistant", finished),
        ]
    )
    assert [link.text for link in links(view)][-1] == "Copy"


def test_an_interrupted_reply_inside_a_fence_leaves_later_messages_usable(qtbot, view, actions):
    cut_off = "```python\nwhile True:\n    <table><tr><td>"
    view.show_messages(
        [
            RenderedMessage(1, "user", "first"),
            RenderedMessage(2, "assistant", cut_off, "cancelled"),
            RenderedMessage(3, "user", "LATER QUESTION"),
            RenderedMessage(4, "assistant", "LATER ANSWER", is_last=True),
        ]
    )
    shown = shown_text(view)
    assert "LATER QUESTION" in shown and "LATER ANSWER" in shown and "Stopped" in shown
    edits = [link for link in links(view) if link.text == "Edit"]
    click_at(qtbot, view, edits[-1].position)
    assert actions == [("edit", 3)]
