"""Pure tier: what a plan record's name depends on (plans.identity), and the cheap lookups
it is made of, checked against the stdlib calls they replace."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest
import torch

import kernelgen.config as config
import kernelgen.plans as plans

PACKAGE = Path(plans.__file__).resolve().parent


@pytest.fixture
def identity(monkeypatch):
    """plans.identity, recomputed on every call (it is memoised per process)."""
    plans.identity.cache_clear()

    def fresh() -> str:
        plans.identity.cache_clear()
        return plans.identity()

    yield fresh
    plans.identity.cache_clear()


def _tree(tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    """A copy of the package and its templates, which identity() then reads instead."""
    package = tmp_path / "kernelgen"
    shutil.copytree(PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__"))
    templates = tmp_path / "templates"
    shutil.copytree(config.template_dir(), templates)
    monkeypatch.setattr(plans, "__file__", str(package / "plans.py"))
    monkeypatch.setattr(config, "template_dir", lambda: templates)
    return package, templates


def _reference_walk(root: Path, suffix: str) -> list[tuple[str, int, int]]:
    found = []
    for directory, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith(suffix):
                st = os.stat(os.path.join(directory, name))
                found.append((Path(directory, name).relative_to(root).as_posix(), st.st_size, st.st_mtime_ns))
    return sorted(found)


def test_walk_lists_every_file_with_its_size_and_mtime():
    for root, suffix in ((PACKAGE, ".py"), (config.template_dir(), ".j2")):
        walked = plans._walk(str(root), suffix)
        assert walked == _reference_walk(root, suffix)
        assert any("/" in path for path, _, _ in walked)  # subdirectories are included


@pytest.mark.parametrize("edit", ["append to a template", "same-size rewrite of a template", "new template",
                                  "remove a template", "append to a .py", "new .py in a subpackage",
                                  "new measured table", "edit a measured table"])
def test_identity_follows_code_and_templates(tmp_path, monkeypatch, identity, edit):
    package, templates = _tree(tmp_path, monkeypatch)
    before = identity()
    assert identity() == before
    target = templates / "cuda" / "direct.cu.j2"
    if edit == "append to a template":
        with open(target, "a") as f:
            f.write("// an edit\n")
    elif edit == "same-size rewrite of a template":
        data = target.read_bytes()
        st = target.stat()
        target.write_bytes(data[::-1])
        os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # as a coarse-clock rewrite would
    elif edit == "new template":
        (templates / "cuda" / "extra.cu.j2").write_text("// new\n")
    elif edit == "remove a template":
        target.unlink()
    elif edit == "append to a .py":
        with open(package / "select.py", "a") as f:
            f.write("# an edit\n")
    elif edit == "new .py in a subpackage":
        (package / "families" / "extra.py").write_text("X = 1\n")
    elif edit == "new measured table":  # (the selector's data: its choice for a call can change)
        (package / "tables").mkdir(exist_ok=True)
        (package / "tables" / "nvidia-h100-80gb-hbm3.json").write_text('{"format": 1, "rows": []}\n')
    elif edit == "edit a measured table":
        (package / "tables").mkdir(exist_ok=True)
        table = package / "tables" / "nvidia-h200.json"
        table.write_text('{"format": 1, "rows": []}\n')
        before = identity()
        table.write_text('{"format": 1, "rows": [], "model": {}}\n')
    assert identity() != before


def test_identity_ignores_bytecode(tmp_path, monkeypatch, identity):
    package, _ = _tree(tmp_path, monkeypatch)
    before = identity()
    (package / "__pycache__").mkdir()
    (package / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0" * 16)
    assert identity() == before


def test_identity_follows_versions(monkeypatch, identity):
    before = identity()
    monkeypatch.setattr(torch, "__version__", torch.__version__ + ".changed")
    assert identity() != before
    monkeypatch.undo()
    monkeypatch.setattr(torch.version, "cuda", "99.9")
    assert identity() != before


def _executable(path: Path, text: str = "#!/bin/sh\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def test_identity_follows_the_host_compiler(tmp_path, monkeypatch, identity):
    bin_dir = tmp_path / "bin"
    cxx = _executable(bin_dir / "kg-test-c++")
    monkeypatch.setenv("CXX", "kg-test-c++")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    before = identity()
    cxx.write_text("#!/bin/sh\n# upgraded in place\n")
    assert identity() != before
    # another one earlier on PATH
    again = identity()
    first = _executable(tmp_path / "first" / "kg-test-c++")
    monkeypatch.setenv("PATH", f"{first.parent}{os.pathsep}{os.environ['PATH']}")
    assert identity() != again


def test_identity_follows_the_nvcc_of_cuda_home(tmp_path, monkeypatch, identity):
    """CUDA_HOME's nvcc builds the kernels even when PATH finds another (or none)."""
    nvcc = _executable(tmp_path / "cuda" / "bin" / "nvcc")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    before = identity()
    nvcc.write_text("#!/bin/sh\n# a newer release, installed in place\n")
    assert identity() != before
    changed = identity()
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "other"))
    assert identity() != changed


def test_identity_follows_a_switched_symlink(tmp_path, monkeypatch, identity):
    a = _executable(tmp_path / "a" / "c++", "#!/bin/sh\n# a\n")
    b = _executable(tmp_path / "b" / "c++", "#!/bin/sh\n# b\n")
    link_dir = tmp_path / "bin"
    link_dir.mkdir()
    (link_dir / "kg-test-c++").symlink_to(a)
    monkeypatch.setenv("CXX", "kg-test-c++")
    monkeypatch.setenv("PATH", f"{link_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    before = identity()
    (link_dir / "kg-test-c++").unlink()
    (link_dir / "kg-test-c++").symlink_to(b)
    assert identity() != before


def test_tool_finds_what_shutil_which_finds(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    not_exec = tmp_path / "not_exec"
    not_exec.mkdir()
    (not_exec / "tool").write_text("")
    (not_exec / "tool").chmod(0o644)
    a_dir = tmp_path / "a_dir"
    (a_dir / "tool").mkdir(parents=True)
    good = _executable(tmp_path / "good" / "tool")
    later = _executable(tmp_path / "later" / "tool")
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "tool").symlink_to(good)
    dangling = tmp_path / "dangling"
    dangling.mkdir()
    (dangling / "tool").symlink_to(tmp_path / "nowhere")
    paths = [[empty, not_exec, a_dir, good, later], [linked, good], [dangling, later], [empty], [],
             [str(empty) + "-missing", later]]
    names = ["tool", "absent", str(good), str(not_exec / "tool"), str(a_dir / "tool")]
    for entries in paths:
        monkeypatch.setenv("PATH", os.pathsep.join(map(str, entries)))
        for name in names:
            found = plans._tool(name)
            expected = shutil.which(name)
            assert (found[0] if found else None) == expected, (entries, name)
            if found:
                st = os.stat(expected)
                assert found[1:] == [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]
                assert not stat.S_ISDIR(st.st_mode)


def test_cuda_home_follows_nvcc_symlinks(tmp_path, monkeypatch):
    nvcc = _executable(tmp_path / "cuda-12.9" / "bin" / "nvcc")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").symlink_to(nvcc)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    assert config.cuda_home(str(tmp_path / "bin" / "nvcc")) == (tmp_path / "cuda-12.9").resolve()
    monkeypatch.setenv("CUDA_PATH", "/opt/cuda")
    assert config.cuda_home(str(tmp_path / "bin" / "nvcc")) == Path("/opt/cuda")


def test_template_dir_holds_the_templates():
    root = config.template_dir()
    assert (root / "binding.cpp.j2").is_file() and root.is_absolute()
    import kernelgen.render as render

    assert render.template_dir() == root


SIG = [[16, 64, 1024, 1024], "torch.float32", "cuda"]
H100, H200 = "nvidia-h100-80gb-hbm3", "nvidia-h200"


def test_record_names_follow_the_target(identity):
    names = {plans.record_name(SIG, "sm_90a", H100), plans.record_name(SIG, "sm_80", H100),
             plans.record_name(SIG[:2], "sm_90a", H100)}
    assert len(names) == 3
    assert plans.record_name(SIG, "sm_90a", H100) == plans.record_name(list(SIG), "sm_90a", H100)


def test_record_names_follow_the_gpu_model(identity):
    # the selector's choice, and a tuned one, can differ between an H100 and an H200 (both sm_90a)
    from kernelgen.device import nominal

    assert (nominal("sm_90a").key, nominal("sm_90a", wide_dram=True).key) == (H100, H200)
    assert plans.record_name(SIG, "sm_90a", H100) != plans.record_name(SIG, "sm_90a", H200)
