"""What every command-line tool shares: one-line errors on stderr with exit code 2, and argparse that speaks so.

    python -m hybridtitan.export_hf | import_hf | eval | generate | plot     (and scripts/prepare_data.py)

A bad argument, a missing folder or a checkpoint that does not fit is one ``error: ...`` line, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


def fail(message: str) -> NoReturn:
    """The tool's answer to bad input: one line on stderr, exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


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
