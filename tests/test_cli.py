"""The `kernelgen` command: warm, cache ls/info/prune/clear/export/import, render, doctor.

Tiers: unmarked tests build nothing; `compile` tests build real kernels through the
CPU family (about a second each), into temporary cache directories.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

import kernelgen
from kernelgen import cli, functional, kernels

ROOT = Path(__file__).resolve().parent.parent
RECORDS = [
    {"input": [2, 4, 12, 12], "weight": [8, 4, 3, 3], "padding": 1, "device": "cpu"},
    {"input": [1, 6, 10, 10], "weight": [6, 1, 3, 3], "groups": 6, "bias": True, "device": "cpu"},
]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv: str) -> tuple[int, dict]:
    code, out, err = run(capsys, *argv, "--json")
    assert out.strip(), err
    return code, json.loads(out)


def forget_loaded() -> None:
    """Drop every in-process memo, so the next call goes to the disk cache."""
    kernels.clear_memo()
    functional.clear_plans()


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(root))
    forget_loaded()
    yield root
    forget_loaded()


@pytest.fixture(scope="module")
def warmed(tmp_path_factory) -> tuple[Path, Path]:
    """(a cache holding RECORDS' kernels, the spec file): built once, copied by each test that needs it."""
    base = tmp_path_factory.mktemp("warmed")
    specfile = write_jsonl(base / "specs.jsonl", RECORDS)
    root = base / "cache"
    code = cli.main(["warm", str(specfile), "--jobs", "1", "--cache-dir", str(root)])
    assert code == 0
    return root, specfile


def copy_of(warmed_root: Path, cache_dir: Path) -> Path:
    shutil.copytree(warmed_root, cache_dir, symlinks=True)
    return cache_dir


def conv_of(record: dict) -> torch.Tensor:
    """Run kernelgen.conv2d on real CPU tensors of a record's shapes."""
    x = torch.rand(record["input"])
    w = torch.rand(record["weight"])
    b = torch.rand(record["weight"][0]) if record.get("bias") else None
    return kernelgen.conv2d(x, w, b, padding=record.get("padding", 0), groups=record.get("groups", 1))


# ---------------------------------------------------------------------------- usage, no builds


def test_help_on_every_command(capsys):
    commands = [[], ["warm"], ["cache"], ["cache", "ls"], ["cache", "info"], ["cache", "clear"], ["cache", "prune"],
                ["cache", "export"], ["cache", "import"], ["render"], ["doctor"]]
    for words in commands:
        code, out, _ = run(capsys, *words, "--help")
        assert code == 0 and "usage: kernelgen" in out, words
    assert run(capsys, "no-such-command")[0] == 2
    assert run(capsys)[0] == 2


def test_python_dash_m(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KERNELGEN_CACHE_DIR": str(tmp_path / "c")}
    p = subprocess.run([sys.executable, "-m", "kernelgen", "cache", "ls", "--json"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == []


def test_warm_needs_something(capsys, cache_dir):
    code, _, err = run(capsys, "warm")
    assert code == 2 and "nothing to warm" in err
    code, _, err = run(capsys, "warm", "--model", "x:y")
    assert code == 2 and "--input-shape" in err
    code, _, err = run(capsys, "warm", "--jobs", "0", "x.json")
    assert code == 2


def test_bad_records_name_file_line_and_field(capsys, cache_dir, tmp_path):
    good = dict(RECORDS[0])
    lines = [
        json.dumps(good),
        json.dumps({**good, "colour": "red"}),  # line 2: unknown field
        json.dumps({**good, "stride": "2"}),  # line 3: wrong type
        json.dumps({**good, "input": [2, 5, 12, 12]}),  # line 4: impossible shape
        "{not json",  # line 5
        json.dumps({**good, "input": [2, 4, 2, 2], "padding": 0}),  # line 6: kernel larger than the input
    ]
    specfile = tmp_path / "bad.jsonl"
    specfile.write_text("\n".join(lines) + "\n")
    code, doc = run_json(capsys, "warm", specfile, "--dry-run")
    assert code == 2
    errors = doc["errors"]
    assert len(errors) == 5
    assert f"{specfile}:2: field 'colour'" in errors[0]
    assert f"{specfile}:3: field 'stride'" in errors[1]
    assert f"{specfile}:4: field 'input'" in errors[2]
    assert f"{specfile}:5:" in errors[3] and "not valid JSON" in errors[3]
    assert f"{specfile}:6: field 'input'" in errors[4]
    assert [i["origin"] for i in doc["items"]] == [f"{specfile}:1"]  # the good record still proceeds
    assert not (cache_dir / "entries").exists() or not any((cache_dir / "entries").iterdir())


def test_json_array_records_have_lines(capsys, cache_dir, tmp_path):
    specfile = tmp_path / "specs.json"
    specfile.write_text("[\n" + json.dumps(RECORDS[0]) + ",\n\n" + json.dumps({**RECORDS[1], "groups": 4}) + "\n]\n")
    code, doc = run_json(capsys, "warm", specfile, "--dry-run")
    assert code == 2
    assert doc["errors"][0].startswith(f"{specfile}:4: field 'weight'")
    assert [i["origin"] for i in doc["items"]] == [f"{specfile}:2"]


def test_warm_spec_is_what_conv2d_compiles():
    from kernelgen.warm import parse_record

    for record in RECORDS:
        x = torch.empty(record["input"])
        w = torch.empty(record["weight"])
        b = torch.empty(record["weight"][0]) if record.get("bias") else None
        expected, _ = functional.spec_for(x, w, b, 1, record.get("padding", 0), 1, record.get("groups", 1))
        assert parse_record(record, "t") == expected


def test_model_convolutions_found_on_meta(capsys, cache_dir, tmp_path):
    (tmp_path / "mymodels.py").write_text(
        "import torch.nn as nn, kernelgen\n"
        "def build():\n"
        "    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),\n"
        "                         kernelgen.Conv2d(8, 8, 3, groups=8, padding=1, padding_mode='reflect'),\n"
        "                         kernelgen.Conv2d(8, 16, 1, bias=False))\n")
    code, doc = run_json(capsys, "warm", "--model", f"{tmp_path / 'mymodels.py'}:build", "--input-shape", "2,3,20,20",
                         "--device", "cpu", "--dry-run")
    assert code == 0, doc
    specs = [i["spec"] for i in doc["items"]]
    assert [(s["in_channels"], s["out_channels"], s["groups"], s["padding"], s["bias"]) for s in specs] == [
        (3, 8, 1, [1, 1, 1, 1], True), (8, 8, 8, [0, 0, 0, 0], True), (8, 16, 1, [0, 0, 0, 0], False)]
    assert torch.cuda.memory_allocated() == 0 if torch.cuda.is_available() else True


@pytest.mark.skipif(not (ROOT / "examples" / "_harness.py").is_file(), reason="examples/ not present")
def test_examples_found(capsys, cache_dir):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    code, doc = run_json(capsys, "warm", "--examples", "--dry-run")
    assert code == 0, doc
    examples = {i["origin"].split(" ")[0] for i in doc["items"]}
    assert examples == {p.name for p in (ROOT / "examples").glob("conv_*.py")}
    assert {i["spec"]["device"] for i in doc["items"]} == {device}
    assert {i["spec"]["dtype"] for i in doc["items"]} == {"float32", "bfloat16"}


@pytest.mark.skipif(bool(torch.version.cuda), reason="torch has CUDA here")
def test_arch_without_cuda_torch_is_a_usage_error(capsys, cache_dir, tmp_path):
    code, _, err = run(capsys, "warm", write_jsonl(tmp_path / "s.jsonl", RECORDS), "--arch", "sm_80,sm_90")
    assert code == 2 and "CPU-only" in err


def _planned_gpus(monkeypatch) -> list:
    """The GPUs the selector is asked to plan for, in order (kernelgen.select.ranked's problem.device)."""
    from kernelgen import select

    seen, real = [], select.ranked
    monkeypatch.setattr(select, "ranked", lambda params, device, problem, *a, **kw: seen.append(problem.device)
                        or real(params, device, problem, *a, **kw))
    return seen


# 480 depthwise channels of one 14 x 14 image: depthwise_planes keeps two blocks an SM, so its
# planes a block follow the GPU's SMs (two on an A100's 108, one on an H100's 132)
PLANES = {"input": [1, 480, 14, 14], "weight": [480, 1, 3, 3], "groups": 480, "padding": 1,
          "family": "depthwise_planes"}


def test_warm_plans_each_arch_for_itself(capsys, cache_dir, tmp_path, monkeypatch):
    """`warm --arch` on a machine without a GPU plans every target as a nominal GPU of that target
    would (the families it can run there, tiles sized for it), and --wide-dram for the target's
    larger-memory part (an H200); a dry run, so nothing is compiled."""
    from kernelgen.device import nominal
    from kernelgen.families import get_family
    from kernelgen.spec import ConvSpec

    monkeypatch.setattr(torch.version, "cuda", torch.version.cuda or "13.0")  # a CUDA torch, no GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    gpus = _planned_gpus(monkeypatch)
    records = write_jsonl(tmp_path / "s.jsonl", [
        {"input": [16, 16, 1024, 1024], "weight": [128, 16, 3, 3], "precision": "tf32"},  # case 63
        {"input": [16, 64, 1024, 1024], "weight": [128, 64, 1, 1], "precision": "tf32"},  # case 87
        PLANES, {"input": [2, 4, 12, 12], "weight": [8, 4, 3, 3], "device": "cpu"}])

    def plans(*extra):
        del gpus[:]
        code, doc = run_json(capsys, "warm", records, "--dry-run", *extra)
        assert code == 0 and not doc["errors"], doc["errors"]
        return doc["items"]

    here = plans("--arch", "sm_80,sm_90a")
    assert set(gpus) == {nominal("sm_80"), nominal("sm_90a"), None}  # (None: the CPU record's)
    cuda = [(i["arch"], ConvSpec.from_dict(i["spec"])) for i in here if i["spec"]["device"] == "cuda"]
    assert sorted(arch for arch, _ in cuda) == ["sm_80"] * 3 + ["sm_90a"] * 3  # each record for each target
    for arch, spec in cuda:  # what each target's GPU can run
        get_family(spec.family).check(spec, nominal(arch))
    planes = {arch: dict(spec.tiles)["planes"] for arch, spec in cuda if spec.family == "depthwise_planes"}
    assert planes == {"sm_80": 2, "sm_90a": 1}
    assert [i["spec"]["family"] for i in here if i["spec"]["device"] == "cpu"] == ["cpu_direct"]  # once
    wide = plans("--arch", "sm_90a", "--wide-dram")
    assert set(gpus) - {None} == {nominal("sm_90a", wide_dram=True)} and gpus[0].name == "NVIDIA H200"
    assert sorted(i["arch"] for i in wide if i["spec"]["device"] == "cuda") == ["sm_90a"] * 3
    code, _, err = run(capsys, "warm", records, "--dry-run", "--wide-dram")
    assert code == 2 and "--wide-dram goes with --arch" in err
    # a family forced where the target cannot run it is that target's error
    forced = write_jsonl(tmp_path / "f.jsonl", [{"input": [16, 16, 1024, 1024], "weight": [128, 16, 3, 3],
                                                 "precision": "tf32", "family": "wgmma"}])
    code, doc = run_json(capsys, "warm", forced, "--dry-run", "--arch", "sm_80,sm_90a")
    assert [i["arch"] for i in doc["items"]] == ["sm_90a"]
    assert len(doc["errors"]) == 1 and "runs on sm_90a (target sm_80)" in doc["errors"][0]


def test_bad_arch_name(capsys, cache_dir, tmp_path):
    code, _, err = run(capsys, "warm", write_jsonl(tmp_path / "s.jsonl", RECORDS), "--arch", "hopper")
    assert code == 2 and "hopper" in err


def test_render_prints_source_with_banner(capsys):
    code, out, _ = run(capsys, "render", "--input", "1,4,8,8", "--weight", "8,4,3,3", "--device", "cpu")
    assert code == 0
    assert out.startswith("// Generated by kernelgen")
    banner = json.loads(out.splitlines()[1][len("// spec: "):])
    assert banner["family"] == "cpu_direct" and banner["in_channels"] == 4
    code, out, _ = run(capsys, "render", "--input", "1,4,8,8", "--weight", "8,4,3,3", "--device", "cuda",
                       "--padding", "same")
    assert code == 0 and "(cuda.cu)" in out.splitlines()[0] and "__global__" in out
    code, _, err = run(capsys, "render", "--input", "1,4,8,8", "--weight", "8,5,3,3", "--device", "cpu")
    assert code == 2 and "field 'input'" in err


def test_render_plans_for_a_named_target(capsys, cache_dir, monkeypatch):
    """`render --arch` plans for a nominal GPU of that target (--wide-dram: its larger-memory part):
    the families it can run there, tiles sized for it."""
    from kernelgen.device import nominal

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    gpus = _planned_gpus(monkeypatch)

    def spec(*argv):
        code, out, err = run(capsys, "render", "--device", "cuda", "--precision", "tf32", *argv)
        assert code == 0, err
        return json.loads(out.splitlines()[1][len("// spec: "):])

    c63 = ("--input", "16,16,1024,1024", "--weight", "128,16,3,3", "--family", "wgmma")
    assert spec(*c63, "--arch", "sm_90a")["family"] == "wgmma" and gpus[-1] == nominal("sm_90a")
    code, _, err = run(capsys, "render", "--device", "cuda", *c63, "--arch", "sm_80")
    assert code == 2 and "runs on sm_90a (target sm_80)" in err
    planes = ("--input", ",".join(map(str, PLANES["input"])), "--weight", ",".join(map(str, PLANES["weight"])),
              "--groups", "480", "--padding", "1", "--family", "depthwise_planes")
    assert spec(*planes, "--arch", "sm_80")["tiles"]["planes"] == 2 and gpus[-1] == nominal("sm_80")
    assert spec(*planes, "--arch", "sm_90a")["tiles"]["planes"] == 1
    c87 = ("--input", "16,64,1024,1024", "--weight", "128,64,1,1")
    spec(*c87, "--arch", "sm_90a", "--wide-dram")
    assert gpus[-1] == nominal("sm_90a", wide_dram=True) and gpus[-1].name == "NVIDIA H200"
    code, _, err = run(capsys, "render", *c87, "--wide-dram")
    assert code == 2 and "--wide-dram goes with --arch" in err
    code, _, err = run(capsys, "render", *c87, "--arch", "sm_80,sm_90a")
    assert code == 2 and "one target" in err


def test_doctor_reports(capsys, cache_dir):
    code, doc = run_json(capsys, "doctor")
    assert code in (0, 1)
    assert doc["torch"] == torch.__version__
    assert doc["cache"]["path"] == str(cache_dir)
    assert {"nvcc", "host_compiler", "cuda_available", "problems"} <= set(doc)
    assert code == (1 if doc["problems"] else 0)


def test_doctor_describes_each_gpu(capsys, cache_dir, monkeypatch):
    # what the families size their tiles for and the selector weighs (kernelgen.device): a GPU faked here
    import types

    from kernelgen import device

    props = types.SimpleNamespace(name="NVIDIA H200", major=9, minor=0, total_memory=143771 << 20,
                                  multi_processor_count=132, shared_memory_per_block_optin=227 << 10,
                                  shared_memory_per_multiprocessor=228 << 10, regs_per_multiprocessor=65536,
                                  L2_cache_size=60 << 20, memory_clock_rate=3_125_000, memory_bus_width=6144,
                                  clock_rate=1_980_000)
    monkeypatch.setattr(torch.version, "cuda", torch.version.cuda or "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    device.of.cache_clear()
    try:
        _, doc = run_json(capsys, "doctor")
        assert doc["gpus"] == [{"index": 0, "name": "NVIDIA H200", "capability": "9.0", "arch": "sm_90a",
                                "memory_gib": 140.4, "sms": 132, "smem_block_kib": 227, "l2_mib": 60,
                                "dram_tb_s": 4.8}]
        _, out, _ = run(capsys, "doctor")
        assert ("GPU 0          NVIDIA H200, compute capability 9.0, arch sm_90a, 140.4 GiB, 132 SMs, 227 KiB shared "
                "memory a block, 60 MiB L2, 4.8 TB/s") in out
    finally:
        device.of.cache_clear()


def test_prune_and_size_parsing():
    from kernelgen.cache_admin import parse_age, parse_size

    assert parse_size("2G") == 2 << 30 and parse_size("1.5MiB") == int(1.5 * (1 << 20)) and parse_size("10") == 10
    assert parse_size("2GB") == 2 * 1000 ** 3
    assert parse_age("7d") == 7 * 86400 and parse_age("90") == 90
    for bad in ("big", "-1G", "2 parsecs"):
        with pytest.raises(ValueError):
            parse_size(bad)


# ---------------------------------------------------------------------------- hostile archives


def _archive(path: Path, members) -> Path:
    """A tar.gz with the given (TarInfo, bytes | None) members."""
    with tarfile.open(path, "w:gz") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def _file(name: str, data: bytes = b"x") -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), data


def _special(name: str, kind: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    return info, None


KEY = "a" * 64
MANIFEST = _file("kernelgen-export.json", b"{}")
HOSTILE = {
    "dotdot": [MANIFEST, _file("../escaped")],
    "absolute": [MANIFEST, _file("/tmp/kernelgen-escaped")],
    "nested dotdot": [MANIFEST, _file(f"entries/{KEY}/../../../escaped")],
    "subdirectory": [MANIFEST, _file(f"entries/{KEY}/sub/escaped")],
    "symlink": [MANIFEST, _special(f"entries/{KEY}/manifest.json", tarfile.SYMTYPE, "/etc/passwd")],
    "hardlink": [MANIFEST, _special(f"entries/{KEY}/lib.so", tarfile.LNKTYPE, "../../x")],
    "device": [MANIFEST, _special(f"entries/{KEY}/x", tarfile.CHRTYPE)],
    "fifo": [MANIFEST, _special(f"entries/{KEY}/x", tarfile.FIFOTYPE)],
    "duplicate": [MANIFEST, _file(f"entries/{KEY}/x"), _file(f"entries/{KEY}/x")],
    "no manifest": [_file(f"entries/{KEY}/manifest.json", b"{}")],
    "not a key": [MANIFEST, _file("entries/notakey/manifest.json")],
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_archive_rejected(capsys, cache_dir, tmp_path, case):
    archive = _archive(tmp_path / "evil.tgz", HOSTILE[case])
    code, _, err = run(capsys, "cache", "import", archive)
    assert code == 2, err
    assert "refusing" in err
    assert not (tmp_path / "escaped").exists() and not Path("/tmp/kernelgen-escaped").exists()
    assert not any((cache_dir / "entries").iterdir())
    assert not any((cache_dir / "staging").iterdir())


def test_not_an_archive(capsys, cache_dir, tmp_path):
    (tmp_path / "junk.tgz").write_bytes(b"not a tar file")
    code, _, err = run(capsys, "cache", "import", tmp_path / "junk.tgz")
    assert code == 2 and "refusing" in err


# ---------------------------------------------------------------------------- builds


@pytest.mark.compile
def test_warm_then_everything_cached(capsys, cache_dir, tmp_path):
    specfile = write_jsonl(tmp_path / "specs.jsonl", RECORDS + [RECORDS[0]])  # a duplicate is warmed once
    code, doc = run_json(capsys, "warm", specfile, "--jobs", "1")
    assert code == 0, doc
    assert (doc["built"], doc["cached"], doc["failed"]) == (2, 0, 0)
    built = {r["key"] for r in doc["results"]}
    code, doc = run_json(capsys, "warm", specfile)
    assert code == 0
    assert (doc["built"], doc["cached"], doc["failed"]) == (2 - 2, 2, 0)
    assert {r["key"] for r in doc["results"]} == built
    # The line-per-spec form (stderr is not a terminal under pytest) and the summary.
    code, out, _ = run(capsys, "warm", specfile)
    assert code == 0 and out.count("cached ") == 2 and "0 built, 2 cached, 0 failed" in out
    # conv2d now finds what warm built: nothing compiles.
    forget_loaded()
    before = kernelgen.stats()
    for record in RECORDS:
        conv_of(record)
    after = kernelgen.stats()
    assert after["compiles"] == before["compiles"]
    assert after["cache_hits"] - before["cache_hits"] == 2


@pytest.mark.compile
def test_failed_build_reported_and_others_proceed(capsys, cache_dir, tmp_path, monkeypatch):
    specfile = write_jsonl(tmp_path / "specs.jsonl", RECORDS[:1])
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    from kernelgen import toolchain

    toolchain.current.cache_clear()
    toolchain.host_compiler_version.cache_clear()
    try:
        code, out, err = run(capsys, "warm", specfile, "--jobs", "1")
    finally:
        monkeypatch.undo()
        toolchain.current.cache_clear()
        toolchain.host_compiler_version.cache_clear()
    assert code == 1
    assert "FAILED" in err and "no-such-compiler" in err
    assert "1 failed" in out


@pytest.mark.compile
def test_concurrent_warms_compile_each_key_once(cache_dir, tmp_path):
    specfile = write_jsonl(tmp_path / "specs.jsonl", RECORDS)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "KERNELGEN_CACHE_DIR": str(cache_dir)}
    cmd = [sys.executable, "-m", "kernelgen", "warm", str(specfile), "--jobs", "2", "--json"]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    docs = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
        docs.append(json.loads(out))
    builds: dict[str, int] = {}
    for doc in docs:
        for r in doc["results"]:
            assert r["status"] in ("built", "cached")
            builds[r["key"]] = builds.get(r["key"], 0) + (r["status"] == "built")
    assert len(builds) == 2 and all(n == 1 for n in builds.values()), builds


@pytest.mark.compile
def test_ls_info_prune_clear(capsys, cache_dir, warmed):
    copy_of(warmed[0], cache_dir)
    code, entries = run_json(capsys, "cache", "ls")
    assert code == 0 and len(entries) == 2
    for e in entries:
        assert e["family"] == "cpu_direct" and e["size"] > 0 and e["arch"] and e["summary"]
    code, out, _ = run(capsys, "cache", "ls")
    assert code == 0 and "2 entries" in out

    key = entries[0]["key"]
    code, info = run_json(capsys, "cache", "info", key[:12])
    assert code == 0 and info["key"] == key and info["status"] == "ok"
    assert info["spec"] == entries[0]["spec"] and info["toolchain"]["torch"] == torch.__version__
    assert all(Path(s).is_file() for s in info["sources"])
    assert run(capsys, "cache", "info", "f" * 64)[0] == 2

    # The entry not used for ten days goes; the other stays.
    old, new = entries[0]["key"], entries[1]["key"]
    stamp = cache_dir / "entries" / old / "last_used"
    stamp.touch()
    os.utime(stamp, (time.time() - 10 * 86400,) * 2)
    (cache_dir / "entries" / new / "last_used").touch()
    code, doc = run_json(capsys, "cache", "prune", "--older-than", "7d", "--dry-run")
    assert code == 0 and [e["key"] for e in doc["removed"]] == [old]
    assert (cache_dir / "entries" / old).is_dir()
    code, doc = run_json(capsys, "cache", "prune", "--older-than", "7d")
    assert [e["key"] for e in doc["removed"]] == [old] and not (cache_dir / "entries" / old).exists()
    code, doc = run_json(capsys, "cache", "prune", "--max-size", "1G")
    assert doc["removed"] == []
    code, doc = run_json(capsys, "cache", "prune", "--max-size", "1")
    assert [e["key"] for e in doc["removed"]] == [new]
    assert run(capsys, "cache", "prune")[0] == 2
    assert run(capsys, "cache", "prune", "--max-size", "lots")[0] == 2

    copy_of(warmed[0], cache_dir / "again")
    code, doc = run_json(capsys, "cache", "clear", "--cache-dir", cache_dir / "again")
    assert code == 0 and doc["removed"] == 2
    assert not any((cache_dir / "again" / "entries").iterdir()) and not any((cache_dir / "again" / "index").iterdir())


@pytest.mark.compile
def test_export_import_served_without_compiling(capsys, tmp_path, warmed, monkeypatch):
    archive = tmp_path / "kernels.tgz"
    code, doc = run_json(capsys, "cache", "export", archive, "--cache-dir", warmed[0])
    assert code == 0 and len(doc["keys"]) == 2
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    assert names[0] == "kernelgen-export.json" and not any(n.endswith((".o", ".ninja")) for n in names)

    fresh = tmp_path / "fresh"
    monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(fresh))
    forget_loaded()
    code, doc = run_json(capsys, "cache", "import", archive, "--trust-unsigned")
    assert code == 0 and doc["imported"] == 2, doc
    code, doc = run_json(capsys, "cache", "import", archive, "--trust-unsigned")
    assert code == 0 and doc["present"] == 2

    before = kernelgen.stats()
    for record in RECORDS:
        conv_of(record)
    after = kernelgen.stats()
    assert after["compiles"] == before["compiles"], "an imported entry was rebuilt"
    assert after["cache_hits"] - before["cache_hits"] == 2
    forget_loaded()


def _rewrite(archive: Path, out: Path, change) -> Path:
    """Copy an export, letting change(name, bytes) -> bytes alter members; the archive manifest is kept."""
    with tarfile.open(archive) as src, tarfile.open(out, "w:gz") as dst:
        for m in src.getmembers():
            data = change(m.name, src.extractfile(m).read())
            info = tarfile.TarInfo(m.name)
            info.size = len(data)
            dst.addfile(info, io.BytesIO(data))
    return out


def _fix_checksums(archive: Path) -> Path:
    """Recompute the archive manifest: a forger who did so still fails the entry's own checks."""
    import hashlib

    with tarfile.open(archive) as tar:
        blobs = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    manifest = json.loads(blobs["kernelgen-export.json"])
    for key, entry in manifest["entries"].items():
        for name in entry["files"]:
            data = blobs[f"entries/{key}/{name}"]
            entry["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    blobs["kernelgen-export.json"] = json.dumps(manifest).encode()
    return _rewrite(archive, archive.with_name("forged-" + archive.name), lambda name, data: blobs[name])


@pytest.mark.compile
def test_import_verifies_checksums_and_toolchain(capsys, cache_dir, tmp_path, warmed):
    archive = tmp_path / "kernels.tgz"
    assert run(capsys, "cache", "export", archive, "--cache-dir", warmed[0])[0] == 0

    # A truncated download is refused as a whole.
    truncated = tmp_path / "truncated.tgz"
    truncated.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    code, _, err = run(capsys, "cache", "import", truncated, "--cache-dir", tmp_path / "c0", "--trust-unsigned")
    assert code == 2 and "refusing" in err

    # A flipped byte in a .so: the archive manifest catches it.
    flip = lambda name, data: (data[:100] + bytes([data[100] ^ 1]) + data[101:]) if name.endswith(".so") else data
    tampered = _rewrite(archive, tmp_path / "tampered.tgz", flip)
    code, doc = run_json(capsys, "cache", "import", tampered, "--cache-dir", tmp_path / "c1", "--trust-unsigned")
    assert code == 1 and doc["failed"] == 2 and doc["imported"] == 0
    assert all("sha256" in e["reason"] for e in doc["entries"])
    # ... and with the archive manifest forged to match, the entry's own manifest does.
    code, doc = run_json(capsys, "cache", "import", _fix_checksums(tampered), "--cache-dir", tmp_path / "c1", "--trust-unsigned")
    assert code == 1 and doc["failed"] == 2 and doc["imported"] == 0
    assert not any((tmp_path / "c1" / "entries").iterdir())

    # Built by another torch: skipped with the reason, not served.
    def other_torch(name: str, data: bytes) -> bytes:
        if name.endswith("/manifest.json"):
            m = json.loads(data)
            m["toolchain"]["torch"] = "1.0.0"
            return json.dumps(m).encode()
        return data

    foreign = _fix_checksums(_rewrite(archive, tmp_path / "foreign.tgz", other_torch))
    code, doc = run_json(capsys, "cache", "import", foreign, "--cache-dir", tmp_path / "c2", "--trust-unsigned")
    assert code == 0 and doc["skipped"] == 2 and doc["imported"] == 0
    assert all("torch '1.0.0' in the archive" in e["reason"] for e in doc["entries"])
    assert not any((tmp_path / "c2" / "entries").iterdir())


def test_model_direct_kernelgen_calls_are_found():
    import torch

    import kernelgen
    from kernelgen.warm import find_model_calls

    class Functional(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(6, 3, 3, 3))

        def forward(self, x):
            return kernelgen.conv2d(x, self.w, padding=1, precision="ieee")

    found = find_model_calls(Functional(), [(2, 3, 16, 16)], device="cpu")
    assert len(found) == 1 and found[0].spec.kernel_size == (3, 3)
