"""What tctune shows on the console: the ``tctune`` logger's lines on stderr, as ``tctune: <message>``.

The command (``tctune.cli.main``) attaches :func:`console_handler` for the whole process; :func:`optimize` of the
Python API (``tctune.api``) shows the same lines while it runs (:func:`console_log`), so both say the same things
(why the search ended before its progress bar's total, which baseline won, ...), the API in its keywords.
"""
from __future__ import annotations

import contextlib
import logging
import sys
from typing import Iterator

#: The format of every line tctune logs to the console.
CONSOLE_FORMAT = "tctune: %(message)s"


class StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at each record (not the one at the first ``main()``): a caller that
    swaps stderr (pytest's capture, a notebook) never leaves tctune's logger writing to a closed stream."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def console_handler() -> logging.Handler:
    """A :class:`StderrHandler` writing ``tctune: <message>`` (:data:`CONSOLE_FORMAT`)."""
    handler = StderrHandler()
    handler.setFormatter(logging.Formatter(CONSOLE_FORMAT))
    return handler


@contextlib.contextmanager
def console_log(quiet: bool) -> Iterator[None]:
    """While the block runs, the ``tctune`` logger's lines go to stderr as the command shows them (INFO and above;
    WARNING and above when ``quiet``), when nothing else would show them: neither that logger nor an ancestor has
    a handler (a caller that configured logging keeps its own set-up, levels included). The logger's level and
    handlers are restored afterwards."""
    logger = logging.getLogger("tctune")
    if logger.hasHandlers():
        yield
        return
    handler, level = console_handler(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING if quiet else logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def is_console(handler: logging.Handler) -> bool:
    """Whether ``handler`` writes to the terminal: a ``StreamHandler`` on ``sys.stdout`` or ``sys.stderr`` (a
    :class:`StderrHandler` always is)."""
    return isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.stderr)


@contextlib.contextmanager
def above_progress_bar(tqdm_class: type) -> Iterator[None]:
    """While the block runs, the ``tctune`` logger's console handlers (:func:`is_console`: the command's
    :func:`console_handler`, :func:`console_log`'s) write through ``tqdm_class.write``, so a log line printed
    while a progress bar of that class is drawn lands on its own line above the bar instead of on the bar's
    line (``tqdm.contrib.logging.logging_redirect_tqdm``, applied only where such a handler exists: a logger
    without one, e.g. a caller's logging set-up on the root logger, is left as it is). Handlers are restored
    afterwards."""
    logger = logging.getLogger("tctune")
    if not any(is_console(h) for h in logger.handlers):
        yield
        return
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm(loggers=[logger], tqdm_class=tqdm_class):
        yield


__all__ = ["CONSOLE_FORMAT", "StderrHandler", "above_progress_bar", "console_handler", "console_log", "is_console"]
