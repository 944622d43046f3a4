"""What the command line prints besides its results: one progress line, and the library's
messages in command-line words.

One job: draw a long command's progress as one line on a terminal (`ProgressLine`), and reword
the remedies of library messages that name a Python option into the flag that sets it
(`cli_words`). Must not: decide what a command does, or print anything but to the stream given.
"""

from __future__ import annotations

import re
import sys
import time

from ..units import human_bytes

# The library's remedies name its Python options; on the command line each is a flag.
_CLI_WORDS = (
    (re.escape("pass SaveOptions(replace='any')"), "pass --replace"),
    (re.escape("SaveOptions.kvstore_request_timeout_s (--request-timeout-s on the command line)"),
     "--request-timeout-s"),
)


def cli_words(message: str) -> str:
    """``message`` with the library's Python option names replaced by the flags that set them."""
    for pattern, flag in _CLI_WORDS:
        message = re.sub(pattern, flag, message)
    return message


class ProgressLine:
    """One progress line on stderr, rewritten in place at most once per `INTERVAL_S`, and only
    on a terminal: what is done (of how much, when known), the rate, and the time left. A
    command shorter than one interval shows none."""

    INTERVAL_S = 0.5

    def __init__(self, label: str, enabled: bool | None = None, stream=None) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self._start = time.monotonic()
        self._last: float | None = None
        self._width = 0

    def __call__(self, done_bytes: int, total_bytes: int | None = None, note: str = "") -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        finished = total_bytes is not None and done_bytes >= total_bytes
        if now - (self._start if self._last is None else self._last) < self.INTERVAL_S and not (
                finished and self._last is not None):
            return
        self._last = now
        elapsed = now - self._start
        rate = done_bytes / elapsed if elapsed > 0 else 0.0
        text = f"{self.label}: {human_bytes(done_bytes)}"
        if total_bytes:
            text += f" of {human_bytes(total_bytes)} ({100 * done_bytes // total_bytes}%)"
        text += f", {human_bytes(rate)}/s"
        if total_bytes and rate > 0 and not finished:
            text += f", {max(0.0, (total_bytes - done_bytes) / rate):.0f} s left"
        if note:
            text += f", {note}"
        self.stream.write("\r" + text + " " * max(0, self._width - len(text)))
        self._width = len(text)
        self.stream.flush()

    def close(self) -> None:
        """End the line (if one was drawn), so that what follows starts on a line of its own."""
        if self.enabled and self._last is not None:
            self.stream.write("\n")
            self.stream.flush()
            self._last = None
