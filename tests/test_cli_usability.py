"""The command line as a user meets it (issue 55): help without torch, help on a bare command,
a closed pipe, torch's NumPy warning, render and doctor on a machine without a GPU, the progress bar.

Unmarked: nothing here builds a kernel.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import kernelgen_cli
from kernelgen import cli

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = [[], ["warm"], ["cache"], ["cache", "ls"], ["cache", "info"], ["cache", "clear"], ["cache", "prune"],
            ["cache", "export"], ["cache", "import"], ["render"], ["doctor"]]


def python(code: str, tmp_path: Path, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KERNELGEN_CACHE_DIR": str(tmp_path / "cache")}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, **kwargs)


def test_help_and_usage_errors_import_no_torch(tmp_path):
    # Each in a fresh interpreter: this one has imported torch already.
    argvs = [words + ["--help"] for words in COMMANDS] + [["--version"], ["warm", "--jobs", "0"], ["nope"]]
    code = ("import sys, kernelgen_cli\n"
            f"for argv in {argvs!r}:\n"
            "    kernelgen_cli.main(argv)\n"
            "    assert 'torch' not in sys.modules and 'kernelgen' not in sys.modules, argv\n"
            "print('ok')\n")
    p = python(code, tmp_path)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr
    assert "usage: kernelgen warm" in p.stdout and "kernelgen 0" in p.stdout


def test_bare_command_prints_its_help(capsys):
    assert kernelgen_cli.main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kernelgen") and "warm" in err and "doctor" in err
    assert kernelgen_cli.main(["cache"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kernelgen cache") and "prune" in err


def test_closed_pipe_is_quiet(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KERNELGEN_CACHE_DIR": str(tmp_path / "cache")}
    for argv in (["-m", "kernelgen"], [str(ROOT / "kernelgen_cli.py")]):
        p = subprocess.Popen([sys.executable, *argv, "cache", "ls", "--json"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        p.stdout.close()  # the reader is gone before anything is written, as `| head -1` is after one line
        err = p.stderr.read()
        assert p.wait(timeout=120) == 141, err
        assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_no_numpy_warning_from_the_command(tmp_path):
    # torch warns at import where NumPy cannot be loaded; the command keeps that off the user's terminal.
    p = python("import sys; sys.modules['numpy'] = None\n"
               "import kernelgen_cli; sys.exit(kernelgen_cli.main(['cache', 'ls']))", tmp_path)
    assert p.returncode == 0, p.stderr
    assert "NumPy" not in p.stderr and "no entries" in p.stdout


def test_render_defaults_to_this_machines_device(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = cli.main(["render", "--input", "1,4,8,8", "--weight", "8,4,3,3"])
    out, err = capsys.readouterr()
    assert code == 0
    assert json.loads(out.splitlines()[1][len("// spec: "):])["device"] == "cpu"
    assert "no GPU is visible" in err and "--arch" in err
    # Asked for by name, CUDA source is still printed, and --arch implies it.
    for extra in (["--device", "cuda"], ["--arch", "sm_90a"]):
        code = cli.main(["render", "--input", "1,4,8,8", "--weight", "8,4,3,3", *extra])
        out, err = capsys.readouterr()
        assert code == 0 and "(cuda.cu)" in out.splitlines()[0] and not err


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_draws_before_the_first_build_ends():
    from kernelgen.toolchain import current
    from kernelgen.warm import Item, Result, parse_record

    tc = current("cpu")
    specs = [parse_record({"input": [1, c, 8, 8], "weight": [4, c, 3, 3], "device": "cpu"}) for c in (2, 3, 5)]
    items = [Item(spec=s, toolchain=tc) for s in specs]
    stream = Tty()
    reporter = cli.Reporter(items, as_json=False, jobs=1, stream=stream)
    try:
        first = stream.getvalue()
        assert "0/3" in first and "ETA ?" in first and specs[0].summary()[:20] in first
        reporter(Result(spec=specs[0], toolchain=tc, status="built", seconds=2.0))
        line = reporter.line(200)
        assert "1/3" in line and "ETA 4 s" in line and specs[1].summary()[:20] in line
        reporter(Result(spec=specs[2], toolchain=tc, status="cached", seconds=0.0))  # out of order
        assert "2/3" in reporter.line(200) and "ETA 2 s" in reporter.line(200)
        assert specs[1].summary()[:20] in reporter.line(200)
        assert len(reporter.line(40)) == 40
    finally:
        reporter.close()
    assert stream.getvalue().endswith("\n")


def test_doctor_sees_a_cuda_home_torch_would_fail_to_link(capsys, tmp_path, monkeypatch):
    """A wrapper nvcc on PATH (/usr/local/bin/nvcc exec'ing the real one) makes torch's builder take
    its parent (/usr/local) as the CUDA home and link -L/usr/local/lib64 -lcudart: doctor says so."""
    from kernelgen import toolchain

    toolkit = tmp_path / "cuda-13.0"
    (toolkit / "include").mkdir(parents=True)
    (toolkit / "include" / "cuda_runtime.h").write_text("")
    (toolkit / "lib64").mkdir()
    (toolkit / "lib64" / "libcudart.so").write_text("")
    wrapper = tmp_path / "local" / "bin" / "nvcc"
    wrapper.parent.mkdir(parents=True)
    wrapper.write_text("#!/bin/sh\n"
                       f'case "$*" in *--dryrun*) echo "#\\$ TOP={toolkit}/bin/.." >&2 ;;\n'
                       '  *--version*) echo "Cuda compilation tools, release 13.0, V13.0.88" ;; esac\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{wrapper.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    toolchain.nvcc_version.cache_clear()
    try:
        assert cli.main(["doctor", "--json"]) in (0, 1)
        doc = json.loads(capsys.readouterr().out)
        build = doc["cuda_build"]
        assert build["home"] == str(tmp_path / "local") and build["toolkit"] == str(toolkit)
        assert str(tmp_path / "local" / "lib64" / "libcudart.so") in build["missing"]
        said = " ".join(doc["notes"] + doc["problems"])
        assert "cannot find -lcudart" in said and f"CUDA_HOME={toolkit}" in said
        # Pointed at the toolkit, nothing is missing.
        monkeypatch.setenv("CUDA_HOME", str(toolkit))
        cli.main(["doctor", "--json"])
        doc = json.loads(capsys.readouterr().out)
        assert doc["cuda_build"]["missing"] == [] and "lcudart" not in " ".join(doc["notes"] + doc["problems"])
    finally:
        toolchain.nvcc_version.cache_clear()
