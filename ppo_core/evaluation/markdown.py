"""Text from users and models as inert Markdown, for reports and Prefect artifacts.

Plain Python, so that the flow process can write its artifacts without importing the model
stack (:mod:`ppo_core.evaluation.evaluate` writes ``report.md`` with it too).
"""

from __future__ import annotations

import re

__all__ = ["escape_markdown"]

# Backslash escapes for Markdown's inline punctuation. CommonMark (GitHub, the Prefect UI's
# renderer) honours a backslash before any ASCII punctuation; Python-Markdown only before these
# (and `|` with tables), so the text reads the same in both.
_BACKSLASHED = {c: "\\" + c for c in "\\`*[](){}#|!"}
# Character references for HTML's characters and for what no backslash set covers everywhere:
# `~` (strikethrough) and `@` (e-mail autolinks, mentions). A reference is text, never markup.
_REFERENCES = {"&": "&amp;", "<": "&lt;", ">": "&gt;", "~": "&#126;", "@": "&#64;"}
_ESCAPES = str.maketrans({**_BACKSLASHED, **_REFERENCES})
# `_` inside a word (snake_case) cannot open or close emphasis in either dialect: left as is,
# so module names and paths stay readable; any other `_` is escaped.
_LONE_UNDERSCORE = re.compile(r"(?<![^\W_])_|_(?![^\W_])")
# Bare links that GitHub-flavoured renderers turn into anchors: break the pattern they look for.
_AUTOLINKS = ((re.compile(r"://"), "&#58;//"), (re.compile(r"(?i)\b(www)\."), r"\1&#46;"))
# A list marker the other escapes leave: the text may start a line (a sample's list item).
_LIST_START = re.compile(r"^([-+]|\d+(?=\.))")
_LINE_BREAK = re.compile(r"\r\n|\r|\n")


def escape_markdown(text: object) -> str:
    """``text`` as inert Markdown for one line of a report: it renders as the same characters
    in CommonMark, GitHub-flavoured Markdown and Python-Markdown, and can add no markup, link,
    image, HTML tag, comment, heading, list, quote, code block or table cell. Leading and
    trailing whitespace is dropped (a renderer would drop it too) and each line break becomes
    ``<br>``, so prompts, responses, paths and reward names from users or models cannot change
    how ``report.md`` (and the Prefect artifact made from it) renders."""
    escaped = str(text).strip().translate(_ESCAPES)
    escaped = _LONE_UNDERSCORE.sub(r"\\_", escaped)
    for pattern, replacement in _AUTOLINKS:
        escaped = pattern.sub(replacement, escaped)
    escaped = _LIST_START.sub(lambda m: m[1] + "\\" if m[1].isdigit() else "\\" + m[1], escaped)
    return _LINE_BREAK.sub("<br>", escaped)
