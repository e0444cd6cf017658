"""What a process forked from the tests' fork server (tests/preloaded.py, tests/helpers.start) runs:
``python -m MODULE`` or ``python SCRIPT`` as Python runs them: ``runpy`` with ``__main__`` as the name and
sys.path[0] as Python sets it, an exception printed with its traceback and exit code 1 (an uncaught
KeyboardInterrupt: the traceback, then death by SIGINT), ``SystemExit``'s code, threading's exit hooks, the threads
joined and the atexit functions run before the process ends. A process whose environment would have changed what the
server's imports did (another PYTHONPATH, TRITON_INTERPRET, ...), or one asked to be fresh (the ranks of a
multi-process run: tests/helpers.run_ranks), becomes a fresh interpreter instead (exec).
Light to import: the tests import it to name the function a fork runs."""

from __future__ import annotations

import atexit
import faulthandler
import io
import os
import runpy
import signal
import sys
import threading
import traceback

# the variables that the interpreter's start or the preloaded libraries read as they are imported (those of the rest,
# a rank's torchrun variables, pytest's, the tests' own, the terminal's size, are read at run time)
READ_AT_IMPORT = ("PYTHON", "TRITON", "TORCH", "HF_", "TRANSFORMERS", "TOKENIZERS", "DATASETS", "LM_EVAL", "FLA_",
                  "OMP_", "MKL_", "KMP_", "CUDA", "LD_")
# ... less those of these names that are read at run time: torchrun's TORCHELASTIC_* (a rank's process group reads
# TORCHELASTIC_USE_AGENT_STORE as it starts)
READ_AT_RUN_TIME = ("TORCHELASTIC_",)


def run_as_python(args: list[str], environ: dict[str, str], cwd: str, stdout: str, stderr: str,
                  fresh: bool = False) -> None:
    """In the forked process: ``python ARGS`` (``-m MODULE ...`` or ``SCRIPT ...``) with ``environ``, in ``cwd``,
    its output appended to the files ``stdout`` and ``stderr``; ends the process with Python's exit code. A fresh
    interpreter (exec) where ``fresh`` asks for one or the environment would change the server's imports."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    for fd, path in ((1, stdout), (2, stderr)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(target, fd)
        os.close(target)
    if fresh or not _imports_alike(environ):
        os.execve(sys.executable, [sys.executable, *args], environ)
    open(stdout + ".forked", "w").close()  # for the tests' side (helpers.Started.communicate): this run is a fork
    # PYTHONUNBUFFERED's streams: written through at once, as the ranks of a crashing run must be
    sys.stdout = io.TextIOWrapper(open(1, "wb", 0, closefd=False), encoding="utf-8", write_through=True,
                                  line_buffering=True)
    sys.stderr = io.TextIOWrapper(open(2, "wb", 0, closefd=False), encoding="utf-8", errors="backslashreplace",
                                  write_through=True, line_buffering=True)
    # a fork that dies of a fatal signal prints the Python stack of each thread (then dies of the signal): a
    # crash in a forked process says where it was
    faulthandler.enable()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    code = 0
    try:
        # sys.path[0] as Python sets it: the working folder for -m, the script's folder for a script
        if args[0] == "-m":
            sys.path.insert(0, cwd)
            sys.argv = [args[1], *args[2:]]  # run_module puts the module's file in argv[0], as `python -m` does
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
            sys.argv = list(args)
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 -- Python's own behaviour: the traceback, exit code 1
        traceback.print_exc()
        code = 1
    try:
        # Python's own shutdown: threading's exit hooks (they stop the thread pools' workers) and the join of the
        # non-daemon threads, then the atexit functions
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        if code == -signal.SIGINT:  # as Python ends on an uncaught KeyboardInterrupt: killed by SIGINT
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)


def _imports_alike(environ: dict[str, str]) -> bool:
    """Whether a fresh interpreter with ``environ`` would import what the server imported as the server did: each
    variable read at import is the server's before its imports, or what its imports set (TORCHINDUCTOR_CACHE_DIR)."""
    from preloaded import ENVIRON_AFTER_IMPORTS, ENVIRON_BEFORE_IMPORTS

    return all(environ.get(k) in (ENVIRON_BEFORE_IMPORTS.get(k), ENVIRON_AFTER_IMPORTS.get(k))
               for k in {*environ, *ENVIRON_BEFORE_IMPORTS}
               if k.startswith(READ_AT_IMPORT) and not k.startswith(READ_AT_RUN_TIME))


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # sys.exit("message"): printed, exit code 1
    return 1
