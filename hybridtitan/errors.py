"""The errors a person can fix, and their one-line form.

Every problem of the input (a recipe, a command line, data, a checkpoint or model folder, an evaluation task) is a
UserError of one of the kinds below, raised with one line that says what is wrong and, where it helps, what to
do. Every command turns one into ``error: <that line>`` on stderr and exit code 2 (hybridtitan.cli.one_line_errors),
never a traceback; anything else is a bug and keeps its traceback.
"""


class UserError(ValueError):
    """A problem of the input that the person running the command can fix."""


class ConfigError(UserError):
    """A bad recipe or override, found before anything is written."""


class DataError(UserError):
    """Training data found unusable while it is read (after the start-up checks): a shard of empty documents."""


class CheckpointError(UserError):
    """A checkpoint folder that is missing, incomplete, damaged or of another model."""


class ConversionError(UserError):
    """A model or folder that cannot be converted (export, import, upcycling)."""


class EvalError(UserError):
    """A bad evaluation request: an unknown task, an output path that cannot be written."""


class ResumeError(UserError):
    """The chosen checkpoint could not be loaded into this run."""


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
