"""The docs' commands run as written: every fenced shell block of README.md, docs/getting-started.md, docs/data.md
and docs/primus.md, in order, in one shell per page, in a copy of the repository (its .venv linked in), with fewer
training steps; for docs/primus.md, a Primus run's checkpoint written first where its block reads one."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# what "fewer steps" means: each --training.steps N becomes N // 5 (at least 2), the debug recipe's trainer runs
# at a quarter of its sequence and half its batch; the quickstart trains 4 such steps; the test command collects
# the suite instead of running it inside itself (CI runs it)
SMALL = "--training.seq_len 128 --training.local_batch_size 2 --training.global_batch_size 4"
TINY = [(re.compile(r"--training\.steps (\d+)"), lambda m: f"--training.steps {max(2, int(m.group(1)) // 5)}"),
        (re.compile(r"(-m hybridtitan\.train --job\.config_file train_configs/debug_hybrid\.toml)"),
         lambda m: f"{m.group(1)} {SMALL}"),
        (re.compile(r"^bash scripts/quickstart\.sh$", re.M),
         lambda m: f"bash scripts/quickstart.sh --training.steps 4 {SMALL}"),
        (re.compile(r"^bash scripts/run_tests\.sh$", re.M), lambda m: "bash scripts/run_tests.sh --collect-only -q")]


def shell_blocks(page: Path) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", page.read_text(), flags=re.S | re.M)


def tiny(script: str) -> str:
    for pattern, replace in TINY:
        script = pattern.sub(replace, script)
    return script


@pytest.fixture
def checkout(tmp_path) -> Path:
    """The tracked files of this checkout (and the files not yet committed), with its .venv."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split()
    copy = tmp_path / "repo"
    for name in files:
        if (REPO / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, copy / name)
    (copy / ".venv").symlink_to(REPO / ".venv")
    return copy


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md", "docs/data.md", "docs/primus.md"])
def test_shell_blocks_run(checkout, page):
    if page == "docs/primus.md":
        from test_primus_checkpoint import write_example_run

        write_example_run(checkout / "outputs" / "primus" / "checkpoints")
    blocks = shell_blocks(REPO / page)
    assert blocks, f"{page} has no shell block"
    script = "set -euo pipefail\n" + "\n".join(tiny(b) for b in blocks)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(["bash", "-c", script], cwd=checkout, capture_output=True, text=True, timeout=1500,
                          env=env)
    assert proc.returncode == 0, f"{page}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    if page == "README.md":
        assert (checkout / "outputs" / "quickstart" / "curves.png").is_file()
        assert "tests/test_train.py: " in proc.stdout, proc.stdout[-2000:]  # the suite collected
    elif page == "docs/data.md":  # shards prepared, planned, trained on, and the run said what it read
        assert (checkout / "outputs" / "data" / "corpus.manifest.json").is_file()
        assert "local batch 4, gradient accumulation 1: OK" in proc.stdout, proc.stdout[-2000:]
        assert "tokens; the run reads" in proc.stdout + proc.stderr
    elif page == "docs/primus.md":  # the recipe written and planned, the checkpoint imported and trained from
        assert (checkout / "zebra_llama_1B.toml").is_file()
        assert "Primus torch format, iteration 20, 2 pipeline stages joined; model only" in proc.stdout
        assert "step-0" in proc.stdout + proc.stderr and (checkout / "outputs" / "primus_ft" / "checkpoint").is_dir()
    else:
        assert (checkout / "outputs" / "first-hf" / "config.json").is_file()
        assert "resumed from" in proc.stdout and "error: unknown option --training.stpes" in proc.stderr
