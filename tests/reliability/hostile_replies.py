"""Replies an attacker would have a model write, to render in the real chat view.

Each entry names what it tries. SECRET marks text a reply tries to hide from the user;
the tests check it is shown. The large entries are a few hundred kB on purpose.
"""

from __future__ import annotations

import base64
import struct
import zlib

SECRET = "SECRETWORD"


def png(size: int = 300) -> bytes:
    """A real PNG of `size` x `size` pixels (big enough to see if it were ever shown)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    rows = b"".join(b"\0" + b"\xff\x00\x00" * size for _ in range(size))
    header = struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )


DATA_PNG = "data:image/png;base64," + base64.b64encode(png()).decode()

# What a reply tries to do with raw HTML.
RAW_HTML = {
    "display none": f'<span style="display:none">{SECRET}</span>',
    "white on white": f'<font color="#ffffff">{SECRET}</font>',
    "zero-size font": f'<span style="font-size:0px">{SECRET}</span>',
    "one-pixel font": f'<p style="font-size:1px">{SECRET}</p>',
    "style block": f"<style>p {{ display:none }}</style>{SECRET}",
    "open comment": f"before <!-- {SECRET}",
    "unclosed table": "<table><tr><td>" * 3 + SECRET,
    "60 nested tables": "<table><tr><td>" * 60 + SECRET,
    "script": f"<script>alert(1)</script>{SECRET}",
    "img file": '<img src="file:///etc/passwd">',
    "img data": f'<img src="{DATA_PNG}">',
    "img huge": '<img width="30000" height="30000" src="x.png">',
    "img qrc": '<img src="qrc:/qt-project.org/styles/commonstyle/images/up-128.png">',
    "stylesheet link": '<link rel="stylesheet" href="file:///etc/passwd">',
    "table background": '<table background="file:///etc/passwd"><tr><td>x</td></tr></table>',
    "css background": '<p style="background-image:url(file:///etc/passwd)">x</p>',
    "forged Edit": '<a href="action:edit:1">Edit</a>',
    "huge font tag": '<font size="100000">X</font>',
    "iframe": '<iframe src="https://example.org"></iframe>',
}

# What a reply tries with Markdown: resources, links the app would act on.
MARKDOWN = {
    "image file": "![x](file:///etc/passwd)",
    "image qrc": "![x](qrc:/qt-project.org/styles/commonstyle/images/up-128.png)",
    "image http": "![pixel](http://127.0.0.1:9/track.png)",
    "image data": f"![x]({DATA_PNG})",
    "image reference": "![x][r]\n\n[r]: file:///etc/passwd",
    "forged actions": "[Edit](action:edit:1) [Regenerate](action:regenerate:0) "
    "[Copy](action:copy-msg:1)",
    "forged token guess": "[Edit](action:00000000000000000000000000000000:edit:1)",
    "link file": "[open](file:///etc/passwd)",
    "link javascript": "[x](javascript:alert(1))",
    "link qrc": "[x](qrc:/x)",
    "link title tooltip": '[x](https://example.org "a title the reply controls")',
    "mail autolink": "<someone@example.org>",
    "entities": "&lt;b&gt; &#x202e; &amp;" * 3,
    "bidi override": f"abc\u202e{SECRET}",
    "NUL and controls": f"a\x00b\x1b[2Jc\r\nd\x7f{SECRET}",
    "open fence (streaming)": f"```python\nprint(1)\n{SECRET}",
    "open think": f"<think>{SECRET}",
}

# Input sized to make layout or parsing blow up.
PATHOLOGICAL = {
    "10,000 >": ">" * 10_000 + f" {SECRET}",
    "quote lines 1..400 deep": "\n".join(">" * i + " x" for i in range(1, 401)),
    "5,000 nested lists, one line": "- " * 5_000 + SECRET,
    "2,000 indented list levels": "\n".join("  " * i + "- item" for i in range(2_000)),
    "200 kB unbroken line": "a" * 200_000,
    "200 kB line of words": "word " * 40_000,
    "50,000 [": "[" * 50_000,
    "20,000 ![": "![" * 20_000,
    "10,000 [a][": "[a][" * 10_000,
    "20,000 setext lines": "-\n" * 20_000,
    "20,000 list items": "- a\n" * 20_000,
    "50,000 emphasis": "*a* " * 50_000,
    "20,000 table rows": "|a|b|\n|-|-|\n" + "|x|y|\n" * 20_000,
    "5,000 table columns": "|" + "a|" * 5_000 + "\n|" + "-|" * 5_000 + "\n|" + "x|" * 5_000,
    "200 kB code block": "```python\n" + "x = 1\n" * 40_000 + "```",
    "100,000 code tokens": "```python\n" + "a+" * 50_000 + "\n```",
    "5,000 code blocks": "```\na\n```\n" * 5_000,
    "100,000 tiny lines": "x\n" * 100_000,
    "50,000 entities": "&amp;" * 50_000,
    "200,000 quotes": '"' * 200_000,
    "12 kB of highlighted tokens": "```python\n" + "a+" * 5_999 + "\n```",
    "1,000 <think>": "<think>" * 1_000,
    "300 kB of ordinary Markdown": (
        "## Heading\n\nSome *text* with `code` and a [link](https://example.org).\n\n"
        "- one\n- two\n\n```python\nprint('hi')\n```\n\n"
    )
    * 2_500,
}

ALL = {**RAW_HTML, **MARKDOWN, **PATHOLOGICAL}
