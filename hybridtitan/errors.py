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
