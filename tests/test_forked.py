"""The tests' forked processes (tests/helpers.start, tests/forked.py) behave as `python SCRIPT` does: its argv, its
environment and folder, its exit code (SystemExit's, 1 with the traceback for an exception, death by SIGINT for an
uncaught KeyboardInterrupt, 0), the atexit functions run at the end; and a process whose environment would change
what the server imported is a fresh interpreter."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

import helpers
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


def test_torchruns_variables_keep_a_fork_and_the_ranks_of_a_run_are_forks(tmp_path):
    """torchrun's TORCHELASTIC_* variables are read at run time: a process with them is still a fork, and so are the
    ranks of a multi-process run (run_ranks). The server they are forked from has one thread."""
    code, out, err = _run(tmp_path, "exit", "0", environ=dict(env(), TORCHELASTIC_USE_AGENT_STORE="True"))
    assert code == 0 and "forked True" in out, out + err
    script = tmp_path / "ranks.py"
    script.write_text("import os, sys\nthreads = len(os.listdir(f'/proc/{os.getppid()}/task'))\n"
                      "print('forked', 'preloaded' in sys.modules, 'server threads', threads)\n")
    proc = run_ranks([str(script)], 2, timeout=300)
    assert proc.returncode == 0 and proc.stdout.count("forked True server threads 1") == 2, proc.stdout + proc.stderr


def test_a_forked_process_that_crashes_is_recorded_and_the_next_ones_are_fresh(tmp_path, monkeypatch):
    """A fork killed by SIGSEGV raises ForkedProcessCrashed with its command, the signal and faulthandler's Python
    stack, and every later process is a fresh interpreter (tests/helpers.run_ranks says why); a fresh process's crash
    is not a fork's: its exit code is returned."""
    monkeypatch.setattr(helpers, "FORK_CRASHES", [])  # this worker's own record and its later processes untouched
    script = tmp_path / "crash.py"
    script.write_text("import os, signal, sys\nprint('forked', 'preloaded' in sys.modules)\n"
                      "def crash():\n    os.kill(os.getpid(), signal.SIGSEGV)\ncrash()\n")
    proc = start([str(script)])
    with pytest.raises(helpers.ForkedProcessCrashed) as raised:
        proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGSEGV
    (crash,) = helpers.FORK_CRASHES
    assert str(raised.value) == crash and crash.startswith(f"{sys.executable} {script}: SIGSEGV\n"), crash
    assert 'in crash' in crash, crash
    proc = start([str(script)])
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGSEGV and "forked False" in out and len(helpers.FORK_CRASHES) == 1, out


def test_a_test_failed_by_a_forked_crash_runs_again_in_fresh_processes(tmp_path):
    """pyproject.toml's --reruns 1 --only-rerun ForkedProcessCrashed, in pytest runs of their own (one under
    pytest-xdist, as the suite runs): a test whose forked rank died of SIGSEGV runs once more, its ranks fresh, and so
    does one whose session fixture failed so (the fixture set up again); only the second run's result counts. A test
    that fails without a crash is not run again."""
    rank = ("import os, signal, sys\\n"
            "if 'preloaded' in sys.modules and os.environ.get('RANK', '1') == '1':\\n"
            "    os.kill(os.getpid(), signal.SIGSEGV)\\n")
    common = f"""
        from pathlib import Path
        import pytest
        from helpers import run_ranks, start

        def ran(name):
            with open(Path(__file__).with_name("runs"), "a") as runs:
                runs.write(name + " ")

        def crashes_where_forked(folder, ranks):
            script = folder / "rank.py"
            script.write_text("{rank}")
            if ranks:
                proc = run_ranks([str(script)], 2, timeout=120)
            else:
                proc = start([str(script)])
                proc.communicate(120)
            assert proc.returncode == 0, proc.returncode
    """
    (tmp_path / "test_inner_ranks.py").write_text(textwrap.dedent(common + """
        def test_ranks(tmp_path):
            ran("ranks")
            crashes_where_forked(tmp_path, ranks=True)

        def test_plain_failure():
            ran("plain")
            assert False
    """))
    (tmp_path / "test_inner_fixture.py").write_text(textwrap.dedent(common + """
        @pytest.fixture(scope="session")
        def made(tmp_path_factory):
            ran("fixture")
            crashes_where_forked(tmp_path_factory.mktemp("made"), ranks=False)
            return "made"

        def test_with_fixture(made):
            assert made == "made"
    """))
    # each file in a pytest run of its own (the first crash makes every later process of a run fresh); the first
    # under pytest-xdist as the suite runs, the second in one process; the options of pyproject.toml
    environ = dict(os.environ, PYTHONPATH=str(ROOT / "tests"))
    runs = [subprocess.Popen([sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir",
                              str(tmp_path), "-p", "conftest", "-p", "no:cacheprovider", "-rAR", "-q", *workers,
                              str(tmp_path / name)], cwd=tmp_path, env=environ, stdout=subprocess.PIPE, text=True)
            for workers, name in ((["-n", "1"], "test_inner_ranks.py"), (["-n", "0"], "test_inner_fixture.py"))]
    ranks, fixture = (run.communicate(timeout=600)[0] for run in runs)
    assert "\n1 failed, 1 passed, 1 rerun in " in ranks, ranks[-4000:]
    assert "FAILED test_inner_ranks.py::test_plain_failure" in ranks, ranks[-4000:]
    assert "\n1 passed, 1 rerun in " in fixture, fixture[-4000:]
    assert sorted((tmp_path / "runs").read_text().split()) == ["fixture", "fixture", "plain", "ranks", "ranks"]
    for out, test in ((ranks, "test_inner_ranks.py::test_ranks"),
                      (fixture, "test_inner_fixture.py::test_with_fixture")):
        assert f"RERUN {test}" in out, out[-4000:]  # pyproject.toml's -rR: the summary names what ran again


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
