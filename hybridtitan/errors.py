"""One-line error messages: what the command-line tools print on bad input."""


def first_error_line(e: BaseException, with_type: bool = False) -> str:
    """One line for an error (its type first if ``with_type``); DCP's CheckpointException (a BaseException whose
    text is a rank listing) gives its first rank's error, stored as (exception, traceback summary)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        e = first[0] if isinstance(first, tuple) else first
    lines = [line for line in str(e).strip().splitlines() if line.strip()] or [""]
    text = lines[0]
    if text.startswith("Caught ") and " in DataLoader worker process " in text and len(lines) > 1:
        # torch re-raises a data-loader worker's error with this opening line and the worker's traceback, whose
        # last line is the original "module.Type: message"
        text = lines[-1].split(f"{type(e).__name__}: ", 1)[-1]
    if with_type:
        return f"{type(e).__name__}: {text}"
    return text or type(e).__name__


class DataError(ValueError):
    """Training data found unusable while it is read (after the start-up checks): a shard of empty documents."""


class ConversionError(ValueError):
    """A model or folder that cannot be converted (export, import, upcycling): reported as one line."""
