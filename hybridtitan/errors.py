"""One-line error messages: what the command-line tools print on bad input."""


def first_error_line(e: BaseException, with_type: bool = False) -> str:
    """One line for an error (its type first if ``with_type``); DCP's CheckpointException (a BaseException whose
    text is a rank listing) gives its first rank's error, stored as (exception, traceback summary)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        e = first[0] if isinstance(first, tuple) else first
    text = (str(e).strip().splitlines() or [""])[0]
    if with_type:
        return f"{type(e).__name__}: {text}"
    return text or type(e).__name__


class DataError(ValueError):
    """Training data found unusable while it is read (after the start-up checks): a shard of empty documents."""


def data_error_line(e: DataError) -> str:
    """One line for a DataError, also when a data-loader worker raised it (torch re-raises it in the main process
    with a message that opens "Caught DataError in DataLoader worker process N." and ends with the original)."""
    lines = [line for line in str(e).strip().splitlines() if line.strip()] or [type(e).__name__]
    if lines[0].startswith("Caught ") and len(lines) > 1:
        return lines[-1].split(f"{type(e).__name__}: ", 1)[-1]
    return lines[0]
