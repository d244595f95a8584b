"""Ending quietly when the reader of the output goes away (``tiercheck ls | head -3``).

A coreutils tool whose output pipe closes is killed by ``SIGPIPE``: no message, and the shell
reports status 141 (128 + 13). Python ignores ``SIGPIPE`` and raises :class:`BrokenPipeError`
instead, at whichever write or flush comes next -- in the middle of a listing, in the JSON
error that would report it, or in the interpreter's last flush at exit ("Exception ignored
... BrokenPipeError", status 120). So the command line writes through :class:`GuardedStream`,
which turns a broken pipe of *its* stream into :class:`OutputClosed` (a broken pipe of a
storage connection stays an :class:`OSError` like any storage failure), and the top level
answers that with :func:`end_quietly`: the stream is pointed at ``/dev/null`` so that nothing
more is written or complained about (the recipe of the Python documentation, "Note on
SIGPIPE" in :mod:`signal`), and the status is :data:`EXIT_PIPE`.
"""

from __future__ import annotations

import os
from typing import IO, Any

__all__ = ["EXIT_PIPE", "GuardedStream", "OutputClosed", "end_quietly"]

#: The status a shell reports for a command killed by SIGPIPE (128 + 13), as for coreutils.
EXIT_PIPE = 128 + 13


class OutputClosed(Exception):
    """The reader of one of the command's output streams went away.

    Not an :class:`OSError`: the handlers that report failures must not catch it (reporting
    would write to the closed stream again).
    """

    def __init__(self, stream: IO[str]) -> None:
        super().__init__("the output pipe was closed")
        #: The stream (the real one, not its guard) whose reader went away.
        self.stream = stream


class GuardedStream:
    """A text stream whose broken pipe is :class:`OutputClosed`; everything else is the
    wrapped stream's."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        """Write ``text`` (see :meth:`io.TextIOBase.write`)."""
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            raise OutputClosed(self.stream) from None

    def flush(self) -> None:
        """Flush the stream."""
        try:
            self.stream.flush()
        except BrokenPipeError:
            raise OutputClosed(self.stream) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def end_quietly(*streams: IO[str]) -> int:
    """Point each of ``streams`` at ``/dev/null`` (what is still buffered for them goes there
    at exit, silently) and return :data:`EXIT_PIPE`.

    A stream without a file descriptor (a test's ``StringIO``) is left as it is.
    """
    for stream in streams:
        try:
            fd = stream.fileno()
        except (AttributeError, OSError, ValueError):
            continue
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, fd)
        finally:
            os.close(devnull)
    return EXIT_PIPE
