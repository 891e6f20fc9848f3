"""Log lines a client cannot forge or flood (docs/reliability.md).

A client's strings (unknown field names, paths, text quoted by an exception) reach the log. Raw,
a newline in one writes a line that looks like the server's own, and a 20 MiB field name adds
20 MiB to the log. ``clip`` quotes one such string for a log line; ``SafeFormatter`` (the
server's log format) escapes control characters and lone surrogates in every message and in the
message of a logged exception, and cuts both to a bounded length. Tracebacks keep their lines:
those come from the code, not the client.
"""

from __future__ import annotations

import logging
import re
import traceback

MAX_QUOTED_CHARS = 80  # of one client string, by clip
MAX_MESSAGE_CHARS = 4000  # of one log message (and of an exception's message)

# C0 / C1 control characters (newlines, ESC), the Unicode line and paragraph separators, and
# lone surrogates (a log stream cannot encode them).
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def _escape_char(m: re.Match) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def escape(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` on one line, control characters escaped, cut to ``limit`` characters (the
    original length noted)."""
    cut = text[:limit]
    out = _UNSAFE.sub(_escape_char, cut)
    return out if len(text) <= limit else f"{out}... [{len(text)} chars]"


def clip(value: object, limit: int = MAX_QUOTED_CHARS) -> str:
    """A client's string quoted for a log line: ``'...'``, escaped and cut to ``limit``."""
    return "'" + escape(str(value), limit) + "'"


class SafeFormatter(logging.Formatter):
    """A ``logging.Formatter`` whose messages are escaped and bounded (see the module doc)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape(record.message)
        return super().formatMessage(record)

    def formatException(self, ei) -> str:
        exc_type, exc, tb = ei
        frames = "".join(traceback.format_tb(tb))
        last = "".join(traceback.format_exception_only(exc_type, exc)).rstrip("\n")
        return f"Traceback (most recent call last):\n{frames}{escape(last)}"
