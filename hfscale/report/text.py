"""Rich text for the report model: runs of plain, bold and code text that each template renders its own way.

Our sentences are written with ``**bold**`` and ```code``` marks; :func:`rich` splits the template into spans
*before* the values (trial names, reasons) are put in, so a value is always plain text and never becomes markup.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """A run of text in one style."""

    text: str
    strong: bool = False
    code: bool = False


Text = tuple[Span, ...]

_MARKS = re.compile(r"(\*\*.+?\*\*|`.+?`)")


def rich(template: str, **values: object) -> Text:
    """``template`` split at its ``**bold**`` and ```code``` marks, each span then filled with ``values``
    (``str.format`` fields); the values are never parsed for marks."""
    spans = []
    for part in _MARKS.split(template):
        if not part:
            continue
        if part.startswith("**") and part.endswith("**") and len(part) > 4:
            spans.append(Span(part[2:-2].format(**values), strong=True))
        elif part.startswith("`") and part.endswith("`") and len(part) > 2:
            spans.append(Span(part[1:-1].format(**values), code=True))
        else:
            spans.append(Span(part.format(**values)))
    return tuple(spans)


def plain(text: str) -> Text:
    """Text with no marks at all (a reason, a description)."""
    return (Span(text),) if text else ()


def as_plain(text: Text) -> str:
    """The words without their styles."""
    return "".join(span.text for span in text)


__all__ = ["Span", "Text", "as_plain", "plain", "rich"]
