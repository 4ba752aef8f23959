"""The parser and the one place input errors become a line on stderr and an exit status."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from ..core.placement.profiles import CatalogError
from ..core.placement.trace import TraceError
from ..core.requests.quantities import QuantityError, clip_text
from ..gpu.protocol import GpuError
from .advise import add_advise_command
from .check import add_check_command
from .flags import EXIT_BAD_INPUT, EXIT_GPU_ERROR, UsageError, part_flags
from .offline import add_offline_commands
from .parts import add_part_commands
from .top import add_top_command

DESCRIPTION = "mig-operator: NVIDIA GPU slices on Kubernetes (MIG instances, or fractions with a memory limit)."


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """``--help`` shows each option's default, unless it has none or its help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if unset or "default" in text or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit 2), like every other bad input of this command; subcommands
    are made with the same class, so each has both.

    A value that starts with a minus and a digit (``--idle-timeout -1s``) is a value, not an option:
    no option of this command looks like that, and the value's own check can then name it. By
    default argparse takes only plain negative numbers as values and says "expected one argument".
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-[0-9]")

    def error(self, message: str) -> NoReturn:
        # argparse quotes whole values (an unknown argument of 5000 characters): keep the line short.
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: {clip_text(message, 300)}; see '{self.prog} --help'\n")


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand; a new one is one more ``sub.add_parser(...)`` with ``set_defaults(func=...)``."""
    parser = Parser(prog="mig-operator", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    add_offline_commands(sub)
    add_part_commands(sub, part_flags())
    add_top_command(sub)
    add_check_command(sub)
    add_advise_command(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        try:
            code = args.func(args)
        except (UsageError, CatalogError, TraceError, QuantityError) as exc:
            print(f"mig-operator: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
        except GpuError as exc:
            # No driver, no permission, a GPU gone: NVML's words in one line, not a traceback.
            print(f"mig-operator: {exc}", file=sys.stderr)
            return EXIT_GPU_ERROR
        # Flushed here, not at exit, so a reader that stopped early is met below.
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # `mig-operator catalog | head -1`: the reader has what it wanted; stop without a word.
        _silence_stdout()
        return 0


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the flush at exit does not fail on the closed pipe again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass  # not a real file (a test's capture): nothing is flushed to a pipe at exit
