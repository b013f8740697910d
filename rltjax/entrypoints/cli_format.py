"""How the ``rltjax`` commands present themselves: help text, logging and progress bars.

Help shows one line a flag, with its default once (none for flags that are off or unset by
default); ``--log-level`` sets the ``rltjax`` loggers (INFO: one line a start-up phase;
DEBUG: the rest); progress bars (``rltjax.progress``) appear only on a terminal.
"""
from __future__ import annotations

import argparse
import logging
import shutil
import sys

LOG_LEVELS = ("debug", "info", "warning", "error")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str):
        super().__init__(prog, max_help_position=36, width=min(110, shutil.get_terminal_size().columns))

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        hidden = default is None or default is False or default is argparse.SUPPRESS or default == []
        if "default" in text or not action.option_strings or hidden:
            return text
        return f"{text} (default: %(default)s)"


def add_log_level(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                   help="info: a line per start-up phase; debug: everything")


def setup_logging(level: str) -> None:
    """Log the ``rltjax`` loggers to stderr at ``level``, one plain line a message."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[rltjax] %(message)s"))
    logger = logging.getLogger("rltjax")
    logger.handlers[:] = [handler]
    logger.propagate = False      # a library's root handler would print each line a second time
    logger.setLevel(level.upper())
