"""The tests' fork server: ``python tests/forked.py``, started once per pytest worker by tests/helpers.py, imports
what the trainer imports (tests/preloaded.py), then forks a child for each request, which runs ``python -m MODULE``
or ``python SCRIPT`` at this script's top level, so that Python itself ends it as it ends any script: SystemExit's
code, an exception's traceback and exit code 1, death by SIGINT for an uncaught KeyboardInterrupt, the threads
joined and the atexit functions run. A child whose environment would have changed what the server's imports did
(another PYTHONPATH, TRITON_INTERPRET, ...), or one asked to be fresh, becomes a fresh interpreter instead (exec).

The protocol, a JSON object per line: requests on stdin ``{"id", "args", "environ", "cwd", "stdout", "stderr",
"fresh"}``; on stdout ``{"id", "pid"}`` once the child is forked and ``{"id", "exit"}`` when it ends (a negative
exit: killed by that signal, as subprocess says it). The server has one thread, so that a fork copies a process
whose every thread it has (POSIX: the fork of a process with more threads may only call async-signal-safe
functions)."""

from __future__ import annotations

import faulthandler
import io
import json
import os
import runpy
import select
import signal
import sys

# the variables that the interpreter's start or the preloaded libraries read as they are imported (those of the rest,
# a rank's torchrun variables, pytest's, the tests' own, the terminal's size, are read at run time)
READ_AT_IMPORT = ("PYTHON", "TRITON", "TORCH", "HF_", "TRANSFORMERS", "TOKENIZERS", "DATASETS", "LM_EVAL", "FLA_",
                  "OMP_", "MKL_", "KMP_", "CUDA", "LD_")
# ... less those of these names that are read at run time: torchrun's TORCHELASTIC_* (a rank's process group reads
# TORCHELASTIC_USE_AGENT_STORE as it starts)
READ_AT_RUN_TIME = ("TORCHELASTIC_",)


def imports_alike(environ: dict[str, str], before: dict[str, str], after: dict[str, str]) -> bool:
    """Whether a fresh interpreter with ``environ`` would import what the server imported as the server did: each
    variable read at import is the server's before its imports (``before``), or what its imports set (``after``:
    TORCHINDUCTOR_CACHE_DIR)."""
    return all(environ.get(k) in (before.get(k), after.get(k)) for k in {*environ, *before}
               if k.startswith(READ_AT_IMPORT) and not k.startswith(READ_AT_RUN_TIME))


def exit_code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def send(message: dict) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())  # never sys.stdout: a buffer would be copied into each fork


def serve() -> dict:
    """Forks a child per request and reports its pid and its end; returns in a child only, with its request."""
    children: dict[int, int] = {}  # pid -> request id
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.05)
        if readable:
            data = os.read(0, 1 << 16)
            if not data:  # the tests' side has gone: so does the server
                sys.exit(0)
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    return request
                children[pid] = request["id"]
                send({"id": request["id"], "pid": pid})
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            send({"id": children.pop(pid), "exit": exit_code(status)})


def become(request: dict, before: dict[str, str], after: dict[str, str]) -> None:
    """In the child: the request's folder, environment and output files; exec'd fresh where the environment would
    change the server's imports, or where asked."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["environ"])
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the server's requests are not the child's to read
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(target, fd)
        os.close(target)
    args = request["args"]
    if request["fresh"] or not imports_alike(request["environ"], before, after):
        os.execve(sys.executable, [sys.executable, *args], request["environ"])
    open(request["stdout"] + ".forked", "w").close()  # for the tests' side (helpers.Started): this run is a fork
    # PYTHONUNBUFFERED's streams: written through at once, as the ranks of a crashing run must be
    sys.stdout = io.TextIOWrapper(open(1, "wb", 0, closefd=False), encoding="utf-8", write_through=True,
                                  line_buffering=True)
    sys.stderr = io.TextIOWrapper(open(2, "wb", 0, closefd=False), encoding="utf-8", errors="backslashreplace",
                                  write_through=True, line_buffering=True)
    # a fork that dies of a fatal signal prints the Python stack of each thread (then dies of the signal): a crash
    # in a forked process says where it was
    faulthandler.enable()
    # sys.path[0] as Python sets it: the working folder for -m, the script's folder for a script
    sys.path[0] = request["cwd"] if args[0] == "-m" else os.path.dirname(os.path.abspath(args[0]))


if __name__ == "__main__":
    # the environment the server was started in, and after the imports of the processes it serves
    BEFORE_IMPORTS = dict(os.environ)
    import preloaded  # noqa: F401

    AFTER_IMPORTS = dict(os.environ)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of the tests ends the server by its closed stdin
    REQUEST = serve()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    become(REQUEST, BEFORE_IMPORTS, AFTER_IMPORTS)
    ARGS = REQUEST["args"]
    del REQUEST
    # at the top level: Python ends the child as it ends any script (exit code, traceback, atexit, threads)
    if ARGS[0] == "-m":
        sys.argv = [ARGS[1], *ARGS[2:]]  # run_module puts the module's file in argv[0], as `python -m` does
        runpy.run_module(ARGS[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(ARGS)
        runpy.run_path(ARGS[0], run_name="__main__")
