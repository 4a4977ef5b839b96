"""The package as a user installs it (issue 55): complete metadata, a wheel that builds without
warnings, and an installed wheel that works from another directory, `warm --examples` included.

The metadata test is pure; the wheel test (tier: compile) builds the wheel with the setuptools
already installed (no download), installs it into a fresh virtual environment that borrows this
one's torch, and runs the command and a CPU call there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_metadata_is_complete():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "BSD-3-Clause" and (ROOT / "LICENSE").is_file()
    assert "BSD 3-Clause" in (ROOT / "LICENSE").read_text()
    classifiers = set(project["classifiers"])
    assert "Operating System :: POSIX :: Linux" in classifiers
    assert {f"Programming Language :: Python :: 3.{v}" for v in (10, 11, 12, 13)} <= classifiers
    assert project["scripts"]["kernelgen"] == "kernelgen_cli:console"
    # The dependencies stay few: what a call needs to render, build and run.
    assert [d.split(">")[0].split("=")[0] for d in project["dependencies"]] == ["torch", "jinja2", "ninja"]


@pytest.mark.compile
def test_installed_wheel_works_from_elsewhere(tmp_path):
    pytest.importorskip("setuptools")
    out = tmp_path / "wheel"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                            str(out), str(ROOT)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert build.returncode == 0, build.stdout + build.stderr
    assert "Package would be ignored" not in build.stdout + build.stderr
    (wheel,) = out.glob("kernelgen-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("kernelgen_cli.py", "kernelgen/templates/binding.cpp.j2", "kernelgen/templates/cpu/direct.cpp.j2",
                   "kernelgen/tables/nvidia-h200.json", "kernelgen/examples/conv_square.py",
                   "kernelgen/examples/_harness.py"):
        assert needed in names, needed
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=300)
    py, script = venv / "bin" / "python", venv / "bin" / "kernelgen"
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   timeout=300, capture_output=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["KERNELGEN_CACHE_DIR"] = str(tmp_path / "cache")

    def run(*argv):
        p = subprocess.run([str(a) for a in argv], cwd=elsewhere, env=env, capture_output=True, text=True,
                           timeout=600)
        assert p.returncode == 0, p.stdout + p.stderr
        return p.stdout

    assert str(venv) in run(py, "-c", "import kernelgen; print(kernelgen.__file__)")
    assert run(script, "--help").startswith("usage: kernelgen")
    assert "specialisation(s) would be warmed" in run(script, "warm", "--examples", "--device", "cpu", "--dry-run")
    assert run(py, "-c", "import torch, kernelgen, torch.nn.functional as F\n"
                         "x, w = torch.randn(1, 4, 9, 9), torch.randn(6, 4, 3, 3)\n"
                         "torch.testing.assert_close(kernelgen.conv2d(x, w, padding=1), F.conv2d(x, w, padding=1))\n"
                         "print('ok')").strip() == "ok"
