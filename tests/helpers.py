"""What the tests of the trainer share: running it for real (its ranks in processes of their own, FSDP2 over gloo;
a single process forked from a server that has imported the package, tests/preloaded.py), reading what a run
wrote, and calling its entry point in-process for the one-line errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "train_configs" / "debug_hybrid.toml")
# small and quick: 2 x 128 tokens per rank and step
QUICK = ["--training.seq_len", "128", "--training.local_batch_size", "2", "--training.global_batch_size", "4",
         "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--validation.enable", "false"]


def env() -> dict:
    """The environment of a trainer subprocess: offline, one thread, this checkout first on the path."""
    out = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    out["PYTHONPATH"] = str(ROOT) + os.pathsep + out.get("PYTHONPATH", "")
    return out


# A forked process killed by one of these died of a fault in native code (run_ranks says what follows)
FATAL_SIGNALS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT}
# The crashes of forked processes in this pytest worker, in order: the command, the signal and the end of its stderr
# (faulthandler's Python stacks). After the first, every process start() starts is a fresh interpreter.
FORK_CRASHES: list[str] = []


def run_train(dump: Path, *extra: str, nproc: int = 2, check: bool = True, timeout: int = 600,
              recipe: str = RECIPE, torchrun: bool = False):
    """``python -m hybridtitan.train`` on the debug recipe: in ``nproc`` ranks (run_ranks), or alone for nproc=1 (no
    process group). ``torchrun=True`` runs it under ``torchrun --standalone`` instead, for the tests of what
    torchrun itself does (the docs, cluster, signal and Slurm tests use it too)."""
    args = ["-m", "hybridtitan.train", "--job.config_file", recipe, "--job.dump_folder", str(dump), *extra]
    if torchrun:
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc_per_node={nproc}", *args], cwd=ROOT, env=env(), capture_output=True,
                              text=True, timeout=timeout)
    elif nproc == 1:
        proc = run_processes(args, [env()], timeout=timeout)
    else:
        proc = run_ranks(args, nproc, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"training failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def run_ranks(args: list[str], nproc: int, *, timeout: float = 600, environ: dict | None = None):
    """``python ARGS`` in ``nproc`` processes, started as torchrun starts them, without its agent process: the
    store the ranks meet at is served from this process (as torchrun's agent serves it: bound before the ranks
    start, so no port is picked and raced for), RANK, LOCAL_RANK, WORLD_SIZE and MASTER_ADDR/PORT are in their
    environment. A process fewer per run: the agent's start and rendezvous cost ~2 s of CPU and of wall time, and
    the ranks read nothing else of it. As torchrun does, the first rank to fail stops the others (they would wait
    for it in their next collective). Returns run_processes' CompletedProcess.

    The ranks are forks of the preloaded server (start()), as a single process is: a fresh rank spends ~4.5 s of CPU
    importing before it trains, and the suite starts ~80 ranks. A forked rank of a 2-rank gloo run died of SIGSEGV
    once (CI, 2026-12-03), of a cause not found; so a forked process killed by a fatal signal raises
    ForkedProcessCrashed (with faulthandler's Python stacks), every later process of this pytest worker is a fresh
    interpreter, and pytest-rerunfailures runs the test once more (pyproject.toml: --only-rerun
    ForkedProcessCrashed): a crash of the product itself recurs in fresh processes and fails the test."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    base = dict(env(), **(environ or {}), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), GROUP_RANK="0",
                TORCHELASTIC_USE_AGENT_STORE="True")
    try:
        return run_processes(args, [dict(base, RANK=str(r), LOCAL_RANK=str(r)) for r in range(nproc)],
                             timeout=timeout)
    finally:
        del store


def run_processes(args: list[str], environs: list[dict], *, timeout: float = 600):
    """``python ARGS`` in one process per environment (start()). The first process to fail stops the others.
    Returns a CompletedProcess: the exit code of the first process that failed (else 0), the processes' output in
    order."""
    procs = [start(args, environ) for environ in environs]
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired([sys.executable, *args], timeout)
            time.sleep(0.05)
        failed = next((p.poll() for p in procs if p.poll()), 0)
        if failed and any(p.poll() is None for p in procs):
            time.sleep(1)  # the others' own error lines first, where they have one
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    outputs, crash = [], None
    for p in procs:
        try:
            outputs.append(p.communicate())
        except ForkedProcessCrashed as e:
            crash = crash or e
    if crash:
        raise crash
    return subprocess.CompletedProcess([sys.executable, *args], failed, "".join(out for out, _ in outputs),
                                       "".join(err for _, err in outputs))


def start(args: list[str], environ: dict | None = None) -> Started:
    """``python ARGS`` (``-m MODULE ...`` or ``SCRIPT ...``) with ``environ`` (default env()) in the repository's
    folder, its output kept in files: forked from the fork server (tests/forked.py: the trainer's, the evaluation's
    and the exports' modules imported), which execs a fresh interpreter where the environment would change what those
    imports did, or once a forked process has crashed (run_ranks)."""
    environ = env() if environ is None else environ
    return Started(args, environ, fresh=bool(FORK_CRASHES))


class ForkedProcessCrashed(Exception):
    """A process forked from the tests' server died of a fatal signal (run_ranks says what follows)."""


class Started:
    """A process of start(), used as a Popen: poll(), kill(), wait(), communicate() -> (stdout, stderr) as text,
    returncode."""

    def __init__(self, args: list[str], environ: dict, fresh: bool = False):
        self.args = [sys.executable, *args]
        self._folder = tempfile.TemporaryDirectory(prefix="hybridtitan-test-")
        self._out, self._err = (os.path.join(self._folder.name, name) for name in ("stdout", "stderr"))
        self._server = _fork_server()
        self._id, self.pid = self._server.request(dict(args=args, environ=environ, cwd=str(ROOT), stdout=self._out,
                                                        stderr=self._err, fresh=fresh))

    @property
    def returncode(self) -> int | None:
        return self._server.exits.get(self._id)

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        if not self._server.wait_exit(self._id, timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Waits for the end (as Popen.communicate: a TimeoutExpired leaves the process running), then the output.
        Raises ForkedProcessCrashed where a fork died of a fatal signal."""
        self.wait(timeout)
        with open(self._out) as out, open(self._err) as err:
            output = out.read(), err.read()
        forked = os.path.exists(self._out + ".forked")  # the server marks a run that is a fork
        self._folder.cleanup()
        if forked and -self.returncode in FATAL_SIGNALS:
            FORK_CRASHES.append(f"{' '.join(self.args)}: {signal.Signals(-self.returncode).name}\n{output[1][-6000:]}")
            raise ForkedProcessCrashed(FORK_CRASHES[-1])
        return output


class _ForkServer:
    """``python tests/forked.py``, started once per pytest worker, and a thread that reads what it reports."""

    def __init__(self):
        # the server imports in a trainer's environment (some modules read it at import), made from this process's
        # environment as the tests found it (not one a test has changed for its own runs)
        server_env = dict(_ENVIRON)
        server_env.update(env())
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "forked.py")], cwd=ROOT, env=server_env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.pids: dict[int, int] = {}
        self.exits: dict[int, int] = {}
        self.changed = threading.Condition()
        self.next_id = 0
        threading.Thread(target=self._read, daemon=True, name="fork-server").start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            message = json.loads(line)
            with self.changed:
                (self.pids if "pid" in message else self.exits)[message["id"]] = message.get("pid",
                                                                                            message.get("exit"))
                self.changed.notify_all()

    def request(self, request: dict) -> tuple[int, int]:
        """Sends a request; returns its id and the child's pid once forked."""
        with self.changed:
            self.next_id += 1
            rid = self.next_id
            self.proc.stdin.write(json.dumps(dict(request, id=rid)) + "\n")
            self.proc.stdin.flush()
            if not self.changed.wait_for(lambda: rid in self.pids or self.proc.poll() is not None, timeout=60):
                raise RuntimeError("the tests' fork server did not fork in 60 s")
            if rid not in self.pids:
                raise RuntimeError(f"the tests' fork server ended ({self.proc.returncode})")
            return rid, self.pids[rid]

    def wait_exit(self, rid: int, timeout: float | None) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: rid in self.exits, timeout=timeout)


_SERVER: _ForkServer | None = None
_ENVIRON = dict(os.environ)


def _fork_server() -> _ForkServer:
    global _SERVER
    if _SERVER is None:
        _SERVER = _ForkServer()
    return _SERVER


def records(dump: Path, kind: str = "loss") -> dict[int, dict]:
    """metrics.jsonl's records holding ``kind`` ("loss": training; "validation/loss"), by step."""
    every = map(json.loads, (dump / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r for r in every if kind in r}


def losses(dump: Path) -> dict[int, float]:
    return {step: r["loss"] for step, r in records(dump).items()}


def state(dump: Path, step: int) -> dict[str, torch.Tensor]:
    """The model weights of a run's checkpoint step-``step``."""
    from hybridtitan.checkpoint import load_model

    model, _ = load_model(str(dump / "checkpoint" / f"step-{step}"))
    return model.state_dict()


def main_error(capsys, argv) -> tuple[int, str]:
    """(exit code, stderr) of the trainer's entry point on ``argv``, in this process."""
    from hybridtitan import train

    with pytest.raises(SystemExit) as exc:
        train.main(argv)
    return exc.value.code, capsys.readouterr().err.strip()


def fake_step(folder: Path, step: int, flavor: str) -> None:
    """A step folder whose model_args.json says ``flavor`` (enough for the checks before training)."""
    from hybridtitan.checkpoint import model_args_to_dict
    from hybridtitan.models import get_flavor

    d = folder / "checkpoint" / f"step-{step}"
    d.mkdir(parents=True)
    (d / ".metadata").write_text("x")
    (d / "model_args.json").write_text(json.dumps(model_args_to_dict(get_flavor(flavor))))
