"""The README's commands are the ones CI runs; it stays short, and its example runs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("## The two commands", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_readme_gives_two_commands():
    main, tests = readme_commands()
    assert "examples/run_all.py" in main
    assert "pytest" in tests


def test_ci_runs_the_readme_test_command():
    _, tests = readme_commands()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci


def test_readme_is_short_and_self_contained():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    assert "](../" not in text and "`../" not in text  # a clone has nothing above its root
    assert "--index-url https://download.pytorch.org/whl/cpu" in text  # no 5 GB of CUDA wheels without a GPU


@pytest.mark.compile
def test_usage_example_runs_here(tmp_path):
    """The README's usage example runs as pasted, on this machine's device (the CPU without a GPU)."""
    text = (ROOT / "README.md").read_text()
    code = text.split("## Usage", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KERNELGEN_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert float(done.stdout.strip().removeprefix("tensor(").split(",")[0].rstrip(")")) < 1e-2
