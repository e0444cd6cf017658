"""The tests' forked processes (tests/helpers.start, tests/forked.py) behave as `python SCRIPT` does: its argv, its
environment and folder, its exit code (SystemExit's, 1 with the traceback for an exception, death by SIGINT for an
uncaught KeyboardInterrupt, 0), the atexit functions run at the end; and a process whose environment would change
what the server imported is a fresh interpreter."""

from __future__ import annotations

import signal
import textwrap

from helpers import ROOT, env, run_ranks, start

SCRIPT = textwrap.dedent("""
    import atexit, os, sys
    atexit.register(print, "atexit ran")
    print("argv", sys.argv[1:], "cwd", os.getcwd(), "HT_TEST_X", os.environ.get("HT_TEST_X"))
    print("forked", "preloaded" in sys.modules)
    if sys.argv[1] == "raise":
        raise ValueError("a bad value")
    if sys.argv[1] == "interrupt":
        raise KeyboardInterrupt
    if sys.argv[1] == "exit":
        sys.exit(int(sys.argv[2]))
""")


def _run(tmp_path, *argv: str, environ: dict | None = None) -> tuple[int, str, str]:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    proc = start([str(script), *argv], environ)
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def test_a_fork_runs_as_python_runs_a_script(tmp_path):
    code, out, err = _run(tmp_path, "exit", "3", environ=dict(env(), HT_TEST_X="seen"))
    assert code == 3 and err == "", err
    assert f"argv ['exit', '3'] cwd {ROOT} HT_TEST_X seen" in out and "forked True" in out
    assert out.rstrip().endswith("atexit ran")
    code, out, err = _run(tmp_path, "raise")
    assert code == 1 and "Traceback" in err and err.rstrip().endswith("ValueError: a bad value"), err
    assert "atexit ran" in out
    code, out, err = _run(tmp_path, "interrupt")
    assert code == -signal.SIGINT and err.rstrip().endswith("KeyboardInterrupt"), (code, err)
    code, out, _ = _run(tmp_path, "end")
    assert code == 0 and "atexit ran" in out


def test_torchruns_variables_keep_a_fork_and_the_ranks_of_a_run_are_fresh(tmp_path):
    """torchrun's TORCHELASTIC_* variables are read at run time: a process with them is still a fork. The ranks of
    a multi-process run (run_ranks) are fresh interpreters (tests/helpers.run_ranks says why)."""
    code, out, err = _run(tmp_path, "exit", "0", environ=dict(env(), TORCHELASTIC_USE_AGENT_STORE="True"))
    assert code == 0 and "forked True" in out, out + err
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    proc = run_ranks([str(script), "end"], 2, timeout=300)
    assert proc.returncode == 0 and proc.stdout.count("forked False") == 2, proc.stdout + proc.stderr


def test_another_start_up_environment_gets_a_fresh_interpreter(tmp_path):
    """PYTHONPATH is read at interpreter start (sitecustomize, .pth): such a process is not a fork."""
    changed = dict(env(), PYTHONPATH=f"{tmp_path}:{env()['PYTHONPATH']}")
    code, out, err = _run(tmp_path, "exit", "0", environ=changed)
    assert code == 0 and "forked False" in out, out + err


def test_a_fork_ends_with_a_thread_pool_still_open(tmp_path):
    """As Python does at exit, threading's exit hooks stop a ThreadPoolExecutor's workers before the threads are
    joined (joining them first waits for ever): a pool that lives as long as the process, as a library's
    module-level one (torch.compile's, the GPU harness's) does."""
    script = tmp_path / "pool.py"
    script.write_text("import sys\nfrom concurrent.futures import ThreadPoolExecutor\n"
                      "sys.pool = ThreadPoolExecutor(2)\nprint(sys.pool.submit(sum, [1, 2]).result())\n")
    proc = start([str(script)])
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and out == "3\n", err
