"""The code passes `ruff check` with the repository's configuration (pyproject.toml [tool.ruff]): pyflakes, pycodestyle
at 120 columns, import order, bugbear and pyupgrade."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "."], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
