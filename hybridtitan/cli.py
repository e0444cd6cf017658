"""What every command-line tool shares: one-line errors on stderr with exit code 2, and argparse that speaks so.

    python -m hybridtitan.export_hf | import_hf | from_primus | tune | eval | generate | plot   (+ prepare_data.py)

A bad argument, a missing folder or a checkpoint that does not fit is one ``error: ...`` line, never a traceback:
the tools raise the errors of hybridtitan.errors (UserError) and their mains run inside ``one_line_errors``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import NoReturn

from hybridtitan.errors import UserError, first_error_line


def fail(message: str) -> NoReturn:
    """The tool's answer to bad input: one line on stderr, exit code 2. Under torchrun every rank meets the same
    fault: rank 0 says it, and every rank exits with the same code."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


@contextlib.contextmanager
def one_line_errors(*also: type[BaseException]):
    """A UserError (or an error of the types in ``also``: the ValueError a data check raises, say) raised inside
    ends the command with ``fail`` of its first line."""
    try:
        yield
    except (UserError, *also) as e:
        fail(first_error_line(e))


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr ("error: ..."), exit code 2."""

    def error(self, message: str) -> NoReturn:
        fail(message)


def parse_size(text: str) -> int:
    """'5GB', '500MB', '10KB' (powers of ten, as Hugging Face) or a number of bytes."""
    units = {"GB": 10**9, "MB": 10**6, "KB": 10**3, "B": 1}
    t = text.strip().upper()
    unit = next((u for u in units if t.endswith(u)), "")
    try:
        size = int(float(t[: len(t) - len(unit)]) * units.get(unit, 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 500MB or bytes)") from None
    if size <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return size
