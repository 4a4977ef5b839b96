"""The five KernelBench examples: faithful problems, drop-in ModelNew, no torch convolution.

Tiers:
- no mark: imports, problem constants, signatures, state_dicts (no kernel is built);
- compile: runs ModelNew on the CPU, so kernelgen builds its CPU kernels;
- gpu: runs examples/run_all.py on the CUDA device at the problems' own shapes.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


@dataclass(frozen=True)
class Problem:
    """What KernelBench's level-1 file defines, copied from the problem, not from the example."""

    number: int
    constants: dict
    init_inputs: list
    input_shape: tuple
    weight_shape: tuple
    output_shape: tuple


PROBLEMS = {
    "conv_pointwise": Problem(
        87, dict(batch_size=16, in_channels=64, out_channels=128, width=1024, height=1024),
        [64, 128], (16, 64, 1024, 1024), (128, 64, 1, 1), (16, 128, 1024, 1024)),
    "conv_asymmetric_kernel": Problem(
        56, dict(batch_size=8, in_channels=64, out_channels=128, kernel_size=(5, 7), height=512, width=256),
        [64, 128, (5, 7)], (8, 64, 512, 256), (128, 64, 5, 7), (8, 128, 508, 250)),
    "conv_square": Problem(
        63, dict(batch_size=16, in_channels=16, out_channels=128, kernel_size=3, width=1024, height=1024),
        [16, 128, 3], (16, 16, 1024, 1024), (128, 16, 3, 3), (16, 128, 1022, 1022)),
    "conv_depthwise": Problem(
        84, dict(batch_size=64, in_channels=128, out_channels=128, kernel_size=3, width_in=512, height_in=256,
                 stride=1, padding=0),
        [128, 128, 3, 1, 0], (64, 128, 256, 512), (128, 1, 3, 3), (64, 128, 254, 510)),
    "conv_depthwise_kx1": Problem(
        83, dict(batch_size=64, in_channels=8, kernel_size=3, width=512, height=512, stride=1, padding=0,
                 dilation=1),
        [8, 3, 1, 0, 1], (64, 8, 512, 512), (8, 1, 3, 1), (64, 8, 510, 512)),
}
NAMES = sorted(PROBLEMS)


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def harness():
    return _load(EXAMPLES / "_harness.py", "kernelgen_examples._harness")


@pytest.fixture(scope="module", params=NAMES)
def example(request):
    return request.param, _load(EXAMPLES / f"{request.param}.py", f"kernelgen_examples.{request.param}")


def _table_results(text: str) -> dict:
    """case -> result column ('PASS', 'FAIL', 'ERROR') of the table run_all.py prints."""
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] != "case":
            out[cells[0]] = cells[-1]
    return out


def _subprocess_env(**extra: str) -> dict:
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


# ---------------------------------------------------------------- no kernel built

def test_every_example_is_listed():
    run_all = (EXAMPLES / "run_all.py").read_text()
    on_disk = {p.stem for p in EXAMPLES.glob("conv_*.py")}
    assert on_disk == set(PROBLEMS)
    assert all(f'"{name}"' in run_all for name in PROBLEMS)


def test_problem_constants(example):
    name, module = example
    problem = PROBLEMS[name]
    assert module.KERNELBENCH_PROBLEM == problem.number
    for constant, value in problem.constants.items():
        assert getattr(module, constant) == value, constant
    assert module.get_init_inputs() == problem.init_inputs


class _FactoryRecorder(TorchFunctionMode):
    """Records the torch functions called (name, args, kwargs), then runs them."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls.append((getattr(func, "__name__", str(func)), args, kwargs))
        return func(*args, **kwargs)


def test_get_inputs_is_the_problems_torch_rand(example):
    # Recorded by a mode, not by monkeypatching torch.rand: torch.device("meta") caches
    # the identity of torch.rand on first use, and a patched one would make every later
    # "meta" tensor a real allocation of gigabytes.
    name, module = example
    with torch.device("meta"), _FactoryRecorder() as recorder:  # the shapes, without allocating
        inputs = module.get_inputs()
    assert [tuple(x.shape) for x in inputs] == [PROBLEMS[name].input_shape]
    assert inputs[0].dtype == torch.float32 and inputs[0].is_meta
    assert recorder.calls == [("rand", PROBLEMS[name].input_shape, {})]


def test_model_is_the_problem(example):
    name, module = example
    problem = PROBLEMS[name]
    model = module.Model(*module.get_init_inputs())
    (conv,) = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert tuple(conv.weight.shape) == problem.weight_shape
    assert conv.bias is None
    with torch.device("meta"):
        (x,) = module.get_inputs()
    assert tuple(model.to("meta")(x).shape) == problem.output_shape


def test_signatures_match(example):
    _, module = example
    assert inspect.signature(module.ModelNew.__init__) == inspect.signature(module.Model.__init__)
    assert inspect.signature(module.ModelNew.forward).parameters.keys() == \
        inspect.signature(module.Model.forward).parameters.keys()


@pytest.mark.parametrize("bias", [False, True])
def test_state_dicts_load_both_ways(example, bias):
    _, module = example
    init = module.get_init_inputs()
    model, new = module.Model(*init, bias=bias), module.ModelNew(*init, bias=bias)
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in new.state_dict().items()}
    new.load_state_dict(model.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), new.state_dict().values()))
    fresh = module.Model(*init, bias=bias)
    fresh.load_state_dict(new.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def test_reduced_shapes_keep_channels(harness, example):
    name, module = example
    opts = harness.Options(device="cpu")
    (shape,) = harness.input_shapes(module, opts)
    n, c, h, w = PROBLEMS[name].input_shape
    assert shape[:2] == (min(n, harness.REDUCED_BATCH), c)
    assert max(shape[2:]) == harness.REDUCED_SIDE
    assert abs(shape[2] / shape[3] - h / w) < 0.1


def test_tolerances(harness):
    y64 = torch.ones(2, 3, 4, 4, dtype=torch.float64)
    ref = torch.nn.Identity()
    x = y64.float()
    exact = harness.compare(x, x.clone(), ref, x, "ieee")
    assert exact.ok and exact.rel_err == 0 and exact.limit == harness.STRICT_REL_ERR
    off = x * (1 + 1e-3)
    # tf32: 1.5x F.conv2d's own error; Model (first argument) is off by 1e-3 here.
    assert harness.compare(off, x * (1 + 1.4e-3), ref, x, "tf32").ok
    assert not harness.compare(off, x * (1 + 1.6e-3), ref, x, "tf32").ok
    assert not harness.compare(x, off, ref, x, "ieee").ok
    nan = x.clone()
    nan[0, 0, 0, 0] = float("nan")
    assert not harness.compare(x, nan, ref, x, "tf32").ok


def test_compare_in_batch_slices_equals_whole(harness, monkeypatch):
    # The GPU cases are checked in batch slices (case 63's output is 17 GB in float64).
    conv = torch.nn.Conv2d(3, 4, 3, bias=False)
    x = torch.rand(5, 3, 8, 8)
    reference = copy.deepcopy(conv).double()
    with torch.no_grad():
        y = conv(x)
        y_new = y + 1e-6 * torch.randn_like(y)
        whole = harness.compare(y, y_new, reference, x, "ieee")
        monkeypatch.setattr(harness, "REFERENCE_CHUNK_ELEMENTS", 2 * y[0].numel())  # slices of 2, 2, 1
        sliced = harness.compare(y, y_new, reference, x, "ieee")
    assert sliced.max_abs == whole.max_abs and sliced.allclose == whole.allclose
    assert sliced.rel_err == pytest.approx(whole.rel_err, rel=1e-12)
    assert sliced.ref_rel_err == pytest.approx(whole.ref_rel_err, rel=1e-12)


# ---------------------------------------------------------------- builds CPU kernels

_BANNED_OP = re.compile(r"conv(?!ert)|^_?(mm|bmm|addmm|addmv|mv|dot|vdot|matmul|baddbmm|addbmm|linear|einsum|"
                        r"tensordot|_int_mm|_scaled_mm)$")


class _AtenRecorder(TorchDispatchMode):
    """Records every aten op that reaches the dispatcher, from Python or from C++."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((func.namespace, func.overloadpacket.__name__))
        if func.namespace == "kernelgen":
            # Under a dispatch mode a kernelgen call is its operator, which would run with this mode
            # popped: run its CPU implementation with the mode pushed, to record what that dispatches.
            with self:
                return func.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def _forbid_torch_convolution(monkeypatch):
    """Make every Python entry point to a torch convolution or matmul raise.

    torch.ops.aten.* is left alone (torch's own lazily imported modules read it); a call
    through it reaches the dispatcher, where _AtenRecorder sees it.
    """

    def forbidden(name):
        def raise_(*args, **kwargs):
            raise AssertionError(f"ModelNew.forward called {name}")
        return raise_

    functional = ["conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
                  "linear", "bilinear"]
    for attr in functional:
        monkeypatch.setattr(torch.nn.functional, attr, forbidden(f"torch.nn.functional.{attr}"))
    for attr in ["conv1d", "conv2d", "conv3d", "convolution", "_convolution", "conv_transpose2d", "matmul",
                 "mm", "bmm", "addmm", "baddbmm", "addbmm", "einsum", "tensordot", "mkldnn_convolution",
                 "cudnn_convolution"]:
        if hasattr(torch, attr):
            monkeypatch.setattr(torch, attr, forbidden(f"torch.{attr}"))
    for attr in ["matmul", "__matmul__", "__rmatmul__", "mm", "bmm"]:
        monkeypatch.setattr(torch.Tensor, attr, forbidden(f"torch.Tensor.{attr}"))
    for attr in dir(torch._C._nn):
        if _BANNED_OP.search(attr):
            monkeypatch.setattr(torch._C._nn, attr, forbidden(f"torch._C._nn.{attr}"))


@pytest.mark.compile
def test_forward_calls_no_torch_convolution(example, monkeypatch):
    name, module = example
    init = module.get_init_inputs()
    model = module.Model(*init)
    new = module.ModelNew(*init)
    new.load_state_dict(model.state_dict())
    n, c, _, _ = PROBLEMS[name].input_shape
    x = torch.rand(2, c, 9, 11)  # odd sizes, above every kernel: edges are exercised
    with torch.no_grad():
        expected = model.double()(x.double())
        _forbid_torch_convolution(monkeypatch)
        with _AtenRecorder() as recorder:
            y = new(x)
    banned = sorted({f"{ns}::{op}" for ns, op in recorder.ops if ns != "kernelgen" and _BANNED_OP.search(op)})
    assert not banned, f"ModelNew.forward dispatched {banned}"
    assert ("kernelgen", "conv2d") in recorder.ops and ("aten", "empty") in recorder.ops
    assert y.shape == expected.shape and y.dtype == torch.float32
    assert torch.linalg.norm(y.double() - expected) / torch.linalg.norm(expected) <= 1e-5


@pytest.mark.compile
@pytest.mark.parametrize("precision", ["ieee", "tf32", "bf16"])
def test_cpu_path_passes(harness, example, precision):
    _, module = example
    opts = harness.Options(precision=precision, device="cpu", checks=2, warmup=0, runs=1, reduced_side=24)
    result = harness.run_case(module, opts)
    assert result.ok, result.why()
    line = harness.result_line(result)
    assert line.endswith("PASS") and f"KernelBench 1/{PROBLEMS[result.case].number}" in line
    # The CPU has no TF32: a 'tf32' run is plain float32 there, and its line says so, as the heading does.
    assert ", tf32," not in line and (", float32," in line) == (precision == "tf32")
    assert _table_results(harness.table([result], opts)) == {f"{result.problem} {result.case}": "PASS"}


@pytest.mark.compile
def test_first_run_compiles_second_is_served_from_cache(tmp_path):
    command = [sys.executable, str(EXAMPLES / "conv_depthwise_kx1.py"), "--device", "cpu", "--checks", "1",
               "--warmup", "0", "--runs", "1"]
    env = _subprocess_env(KERNELGEN_CACHE_DIR=str(tmp_path / "cache"))
    first = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    assert re.search(r"kernelgen compiled [1-9]\d* kernel\(s\) on the first call", first.stdout), first.stdout
    assert "kernelgen" in first.stderr  # the compile log: spec and seconds
    second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "nothing compiled; served from kernelgen's cache" in second.stdout, second.stdout


@pytest.mark.compile
def test_run_all_on_the_cpu_path():
    command = [sys.executable, str(EXAMPLES / "run_all.py"), "--device", "cpu", "--checks", "1", "--warmup", "0",
               "--runs", "1"]
    done = subprocess.run(command, env=_subprocess_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    why = "no CUDA device" if not torch.cuda.is_available() else "--device cpu"
    assert f"CPU path ({why}): reduced shapes" in done.stdout
    assert "TF32 does not apply on the CPU" in done.stdout and "for correctness and portability" in done.stdout
    results = _table_results(done.stdout)
    assert results == {f"{p.number} {name}": "PASS" for name, p in PROBLEMS.items()}, done.stdout


# ---------------------------------------------------------------- the GPU

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["tf32", "ieee", "bf16"])
def test_run_all_on_the_gpu(precision):
    done = subprocess.run([sys.executable, str(EXAMPLES / "run_all.py"), "--precision", precision],
                          env=_subprocess_env(), capture_output=True, text=True, timeout=3600)
    print(done.stdout)
    results = _table_results(done.stdout)
    assert len(results) == len(PROBLEMS), done.stdout + done.stderr[-4000:]
    bad = {case: status for case, status in results.items() if status != "PASS"}
    assert not bad, f"{bad}\n{done.stdout}\n{done.stderr[-4000:]}"
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_bench_ceiling_says_it_has_nothing_to_measure_without_a_gpu():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_ceiling.py")], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "no CUDA device" in r.stdout


@pytest.mark.nvcc
@pytest.mark.compile
@pytest.mark.skipif(__import__("shutil").which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("name", ["store_patterns.cu", "store_lines.cu", "store_strips.cu", "move87.cu",
                                  "pw87_tile.cu"])
def test_store_benchmarks_compile(name, tmp_path):
    # The stand-alone CUDA benchmarks the results and templates cite must keep building.
    r = subprocess.run(["nvcc", "-O3", "-arch=sm_90", "-o", str(tmp_path / "b"), str(ROOT / "benchmarks" / name)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


def test_profiling_scripts_parse():
    # The Nsight Compute wrapper is only run on the GPU host: its bash and the case runner's
    # options (--padding for case 63's aligned twin) must at least parse here.
    for script in ("ncu_cases.sh", "gpu_all.sh"):
        r = subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / script)], capture_output=True, text=True)
        assert r.returncode == 0, (script, r.stderr)
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "profile_case.py"), "--help"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "--padding" in r.stdout and "--tiles" in r.stdout


def _bench_layers():
    spec = importlib.util.spec_from_file_location("bench_layers", ROOT / "benchmarks" / "bench_layers.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


def test_bench_layers_summary_counts_both_timings():
    # Each (precision, format) line counts the layers won and the geometric mean, once for the
    # latency timing and once for the back-to-back (stream) timing, which can disagree.
    rows = [dict(layer="a", precision="tf32", format="cl", family="f", speedup=1.25, stream_speedup=0.5),
            dict(layer="b", precision="tf32", format="cl", family="g", speedup=0.8, stream_speedup=0.5),
            dict(layer="c", precision="bf16", format="nchw", family="f", speedup=2.0, stream_speedup=1.0),
            dict(layer="d", precision="bf16", format="nchw", error="RuntimeError: x")]
    lines = _bench_layers().summary(rows)
    assert lines[2] == "| tf32 | cl | 2 | 1 | 1 | 1.00x | b 0.80x (g) | 0 | 0.50x |"
    assert lines[3] == "| bf16 | nchw | 1 | 1 | 0 | 2.00x | c 2.00x (f) | 1 | 1.00x |"
    assert len(lines) == 4


@pytest.mark.parametrize("measured,expect", [
    ([(0.05, 0.04)], (0.05, 0.04, 1)),  # within its latency: taken as it is
    ([(0.20, 0.04), (0.05, 0.05)], (0.05, 0.04, 2)),  # kernelgen's held up once: the least of each
    ([(0.05, 0.30), (0.06, 0.25), (0.05, 0.04)], (0.05, 0.04, 3)),
    ([(0.20, 0.04)] * 6, (0.20, 0.04, 4)),  # never settles: STREAM_TRIES, and the row says so
])
def test_bench_layers_measures_a_held_up_stream_time_again(measured, expect, monkeypatch):
    # A stream time over 1.1x the call's latency cannot be the kernels' own: measured again.
    bench = _bench_layers()
    queue = list(measured)
    monkeypatch.setattr(bench, "stream_ms", lambda fk, ft: queue.pop(0))
    assert bench.stream_pair(None, None, 0.1, 0.1) == expect
    row = dict(stream_tries=expect[2])
    assert bench.retried(row) == ("" if expect[2] == 1 else f", {expect[2]} tries")


def test_bench_layers_lists_its_layers_without_a_gpu():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_layers.py"), "--list"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("\n") == 28 and "r50.stem" in r.stdout and "rx50.l4.g32" in r.stdout


def _bench_variants():
    spec = importlib.util.spec_from_file_location("bench_variants", ROOT / "benchmarks" / "bench_variants.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_CALL = {"input": [4, 64, 14, 14], "weight": [64, 16, 3, 3], "padding": 1, "groups": 4, "bias": True}


def test_bench_variants_groups_records_that_differ_only_in_family_and_tiles(tmp_path):
    calls = tmp_path / "calls.jsonl"
    calls.write_text("\n".join(json.dumps(r) for r in (
        {**_CALL, "precision": "tf32"},
        {**_CALL, "precision": "tf32", "family": "grouped_mma", "tiles": {"transpose": 1}},
        {**_CALL, "dtype": "bfloat16"},  # another call: its dtype differs
        {**_CALL, "precision": "tf32", "family": "igemm"},
    )) + "\n")
    bench = _bench_variants()
    groups, errors = bench.load_groups(str(calls))
    assert errors == []
    assert [[bench.variant_label(r) for _, r in members] for _, members in groups] == [
        ["default", "grouped_mma[transpose=1]", "igemm"], ["default"]]
    assert [o for o, _ in groups[0][1]] == [f"{calls}:1", f"{calls}:2", f"{calls}:4"]
    assert bench.precision_of({**_CALL}) == "tf32" and bench.precision_of({**_CALL, "dtype": "float16"}) == "fp16"


def test_bench_variants_dry_run_plans_each_variant_without_a_gpu(tmp_path):
    calls = tmp_path / "calls.json"
    calls.write_text(json.dumps([
        {**_CALL, "precision": "tf32"},
        {**_CALL, "precision": "tf32", "family": "grouped_mma", "tiles": {"transpose": 1}},
        {**_CALL, "dtype": "bfloat16", "memory_format": "channels_last", "family": "grouped_mma",
         "tiles": {"transpose": 1}},  # channels_last reads in place: refused, and named
    ], indent=1))
    script = ROOT / "benchmarks" / "bench_variants.py"
    r = subprocess.run([sys.executable, str(script), str(calls), "--dry-run", "--arch", "sm_90a"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "# planned for sm_90a"
    assert "grouped_mma[" in lines[2] and "transpose=0" in lines[2] and "nchw" in lines[2]
    assert "transpose=1" in lines[3]
    third = [i for i, line in enumerate(calls.read_text().splitlines(), 1) if line.strip() == "{"][2]
    assert f"{calls}:{third}" in lines[5] and "FAILED" in lines[5] and "transpose=1 serves NCHW calls" in lines[5]
    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps(json.loads(calls.read_text())[:2]))
    r = subprocess.run([sys.executable, str(script), str(ok), "--dry-run", "--arch", "sm_90a"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    if not torch.cuda.is_available():  # the timing itself needs a GPU, and says so
        r = subprocess.run([sys.executable, str(script), str(ok)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and "needs a CUDA device" in r.stderr


@pytest.mark.parametrize("calls", sorted(p.name for p in (ROOT / "benchmarks" / "calls").glob("*.jsonl")))
def test_bench_variants_call_files_resolve(calls):
    # The A/B call files kept in the repo must still plan (families and tile names move on).
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_variants.py"),
                        str(ROOT / "benchmarks" / "calls" / calls), "--dry-run", "--arch", "sm_90a"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "FAILED" not in r.stdout, r.stdout + r.stderr
