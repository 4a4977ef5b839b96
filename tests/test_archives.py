"""Archives and manifests from elsewhere (issue 54, item 7): signed exports, unsigned archives
refused unless trusted, manifest fields validated, nothing printed raw, imports capped."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
import torch

import kernelgen
from kernelgen import cache_admin, cli

pytestmark = pytest.mark.compile


def run(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A cache holding one CPU kernel (built by a call, as users build them)."""
    import os

    from kernelgen import functional, kernels

    root = tmp_path_factory.mktemp("archives") / "cache"
    old = os.environ.get("KERNELGEN_CACHE_DIR")
    os.environ["KERNELGEN_CACHE_DIR"] = str(root)
    try:
        kernels.clear_memo()
        functional.clear_plans()
        kernelgen.conv2d(torch.randn(1, 3, 8, 8), torch.randn(4, 3, 3, 3), padding=1)
    finally:
        kernels.clear_memo()
        functional.clear_plans()
        if old is None:
            del os.environ["KERNELGEN_CACHE_DIR"]
        else:
            os.environ["KERNELGEN_CACHE_DIR"] = old
    return root


@pytest.fixture
def secret(tmp_path, capsys) -> Path:
    path = tmp_path / "secret"
    code, out, _ = run(capsys, "cache", "keygen", path)
    assert code == 0 and oct(path.stat().st_mode & 0o777) == "0o600"
    return path


def _import(capsys, archive, dest, *extra):
    code, out, err = run(capsys, "cache", "import", archive, "--cache-dir", dest, "--json", *extra)
    return code, (json.loads(out) if out.strip() else None), err


def test_unsigned_archives_are_refused_unless_trusted(capsys, tmp_path, built):
    archive = tmp_path / "k.tgz"
    code, out, _ = run(capsys, "cache", "export", archive, "--cache-dir", built)
    assert code == 0 and "unsigned" in out
    code, doc, err = _import(capsys, archive, tmp_path / "a")
    assert code == 2 and "not signed" in err and doc is None
    assert not (tmp_path / "a" / "entries").exists() or not any((tmp_path / "a" / "entries").iterdir())
    code, doc, err = _import(capsys, archive, tmp_path / "a", "--trust-unsigned")
    assert code == 0 and doc["imported"] == 1, err


def test_signed_archives_verify_with_the_same_secret_only(capsys, tmp_path, built, secret):
    archive = tmp_path / "k.tgz"
    assert run(capsys, "cache", "export", archive, "--cache-dir", built, "--secret", secret)[0] == 0
    code, doc, err = _import(capsys, archive, tmp_path / "a", "--secret", secret)
    assert code == 0 and doc["imported"] == 1, err
    other = tmp_path / "other"
    cache_admin.new_secret(other)
    code, doc, err = _import(capsys, archive, tmp_path / "b", "--secret", other)
    assert code == 2 and "does not match your secret" in err
    code, doc, err = _import(capsys, archive, tmp_path / "b")
    assert code == 2 and "no secret was given" in err


def test_a_signed_archive_changed_after_signing_is_refused(capsys, tmp_path, built, secret):
    archive = tmp_path / "k.tgz"
    assert run(capsys, "cache", "export", archive, "--cache-dir", built, "--secret", secret)[0] == 0
    with tarfile.open(archive) as tar:
        blobs = [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]
    forged = tmp_path / "forged.tgz"
    with tarfile.open(forged, "w:gz") as tar:
        for name, data in blobs:
            if name == "kernelgen-export.json":  # checksums recomputed by a forger: the signature still fails
                m = json.loads(data)
                m["created"] = 0
                data = json.dumps(m).encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    code, doc, err = _import(capsys, forged, tmp_path / "a", "--secret", secret)
    assert code == 2 and "does not match your secret" in err


def test_a_secret_readable_by_others_is_refused(capsys, tmp_path, built, secret):
    secret.chmod(0o644)
    code, _, err = run(capsys, "cache", "export", tmp_path / "k.tgz", "--cache-dir", built, "--secret", secret)
    assert code == 2 and "readable by other users" in err


def test_imports_are_capped(capsys, tmp_path, monkeypatch):
    archive = tmp_path / "many.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        for i in range(20):
            info = tarfile.TarInfo(f"entries/{'a' * 64}/f{i}")
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    monkeypatch.setattr(cache_admin, "MAX_ARCHIVE_MEMBERS", 10)
    code, _, err = run(capsys, "cache", "import", archive, "--cache-dir", tmp_path / "c", "--trust-unsigned")
    assert code == 2 and "more than 10 files" in err
    monkeypatch.setattr(cache_admin, "MAX_ARCHIVE_MEMBERS", 1000)
    monkeypatch.setattr(cache_admin, "MAX_ARCHIVE_BYTES", 5)
    code, _, err = run(capsys, "cache", "import", archive, "--cache-dir", tmp_path / "c", "--trust-unsigned")
    assert code == 2 and "refusing" in err


def _copy(built: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(built, dest)
    return dest


def _edit_manifest(root: Path, **fields) -> None:
    (entry,) = (root / "entries").iterdir()
    m = json.loads((entry / "manifest.json").read_text())
    m.update(fields)
    (entry / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("fields", [dict(created="yesterday"), dict(created=None), dict(summary=["x"]),
                                    dict(toolchain="x"), dict(spec=3), dict(so={"file": "x.so", "size": "1"})])
def test_bad_manifest_fields_break_no_command(capsys, tmp_path, built, fields):
    root = _copy(built, tmp_path / "cache")
    _edit_manifest(root, **fields)
    for argv in (["cache", "ls"], ["cache", "prune", "--older-than", "1000d"], ["cache", "export", tmp_path / "x.tgz"],
                 ["doctor"], ["cache", "ls", "--json"]):
        code, out, err = run(capsys, *argv, "--cache-dir", root)
        assert code in (0, 1) and "Traceback" not in err, (argv, err)


def test_control_characters_are_not_printed(capsys, tmp_path, built):
    root = _copy(built, tmp_path / "cache")
    _edit_manifest(root, summary="evil\x1b]0;owned\x07\x1b[2J\rspoof\u202e")
    code, out, err = run(capsys, "cache", "ls", "--cache-dir", root)
    assert code == 0
    assert not any(c in out for c in "\x1b\x07\r\u202e"), repr(out)
    assert "evil" in out and "spoof" in out
    (entry,) = (root / "entries").iterdir()
    code, out, err = run(capsys, "cache", "info", entry.name[:12], "--cache-dir", root)
    assert not any(c in out for c in "\x1b\x07\r\u202e"), repr(out)
