"""Text from outside the server (a request, a file name) made fit for one log line or message.

It lives here, below `server/` and `adapters/`, so that every package's log calls use it.
"""

from __future__ import annotations

from hotlora.config.errors import HotloraError


def printable(text: object) -> str:
    """`text` with each character that is not printable (line breaks, terminal escapes, bidi
    overrides) written as its Python escape: text from a request can neither start a log line
    of its own nor restyle one."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def clipped(text: str, most: int, keep: int | None = None) -> str:
    """`text` as it is when it holds `most` characters at most, else its first `keep` (`most`
    when not given) and "...": a value a client sent, shown in a message without all of it."""
    if len(text) <= most:
        return text
    return f"{text[: most if keep is None else keep]}..."


def one_line(exc: BaseException) -> str:
    """What `exc` says, on one line; its type's name where it says nothing (a MemoryError),
    and before its words where it is no error this project or the system reports."""
    words = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    if not words:
        return type(exc).__name__
    if isinstance(exc, (HotloraError, ValueError, RuntimeError, OSError)):
        return words
    return f"{type(exc).__name__}: {words}"
