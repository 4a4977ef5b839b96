"""Check and time a KernelBench `Model` against its kernelgen `ModelNew`.

The logic shared by the five examples and `run_all.py`: each example file holds only
the problem (Model, its test-code constants, get_inputs, get_init_inputs) and the
kernelgen module (ModelNew); everything that checks and times the pair lives here.

Accuracy, following docs/performance.md's accuracy rules. Every check draws fresh random inputs the way the
problem does (`torch.rand`), runs Model and ModelNew with the same weights, and
measures two things:

- KernelBench's own test: torch.allclose(Model(x), ModelNew(x), atol=1e-2, rtol=1e-2);
- relative error against F.conv2d computed in float64 on the same inputs and weights,
  ||y - y64|| / ||y64||, for ModelNew and for Model (that is, F.conv2d's own error).

The relative error must stay within a limit that depends on the precision:

- ieee  (float32, TF32 off for cuDNN and kernelgen alike): 1e-5;
- tf32  (float32, PyTorch's default: cuDNN may use TF32): 1.5x F.conv2d's own error;
- bf16  (model and inputs in bfloat16): 1.5x F.conv2d's own error.

The last two never go below the strict 1e-5: where F.conv2d does not round at all
(PyTorch's depthwise kernels never use TF32; the CPU has no TF32) its own error is a
few 1e-8, and 1.5x that would ask for bit-level agreement with one summation order,
not for TF32-class accuracy. A kernel that rounds to TF32 there still fails (~1e-4).

Pass/fail is about accuracy only; the timing columns report, they do not judge.

Timing: both modules in the same process, alternating run by run so that clock and
thermal drift hit both alike; CUDA events on the GPU, time.perf_counter on the CPU;
the median of `runs` runs after `warmup` warm-up runs.

On a machine without CUDA (or with --device cpu) the same five cases run on the CPU at
reduced shapes: batch at most REDUCED_BATCH, height and width scaled together so the
longer side is REDUCED_SIDE; channels and kernels stay the problem's own.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import logging
import math
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Callable, Sequence

# On the CPU, F.conv2d (torch's OpenMP) and ModelNew (the kernel's own OpenMP) run in turns. With
# OpenMP's default active wait each runtime's idle threads spin on the cores the other one then
# needs, and on a machine of few cores a case's times swung 0.2x-1.6x between runs (F.conv2d at
# 1.4 or 32 ms). Passive waiting lets each side have the cores; set before torch loads its runtime.
# A script's choice, not the library's: set OMP_WAIT_POLICY yourself to measure otherwise.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

PRECISIONS = ("ieee", "tf32", "bf16")
PRECISION_LABELS = {
    "ieee": "float32, strict (TF32 off)",
    "tf32": "float32, TF32 allowed (PyTorch's default)",
    "bf16": "bfloat16",
}
KERNELBENCH_ATOL = KERNELBENCH_RTOL = 1e-2
STRICT_REL_ERR = 1e-5
REFERENCE_FACTOR = 1.5
REDUCED_BATCH = 2
REDUCED_SIDE = 64
# The float64 reference runs on batch slices of at most this many output elements,
# so that case 63 (2.1e9 outputs, 17 GB in float64) never exists in float64 at once.
REFERENCE_CHUNK_ELEMENTS = 1 << 27

EXAMPLES_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Options:
    """How to run a case. `device` None means CUDA when available, else the CPU."""

    precision: str = "tf32"
    device: str | None = None
    checks: int = 3
    warmup: int | None = None  # None: 5 on CUDA, 1 on the CPU
    runs: int | None = None  # None: 20 on CUDA, 5 on the CPU
    reduced_batch: int = REDUCED_BATCH
    reduced_side: int = REDUCED_SIDE

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r}; expected one of {', '.join(PRECISIONS)}")
        if self.device not in (None, "cuda", "cpu"):
            raise ValueError(f"device={self.device!r}; expected 'cuda' or 'cpu'")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch.cuda.is_available() is False; use --device cpu")
        if self.checks < 1:
            raise ValueError(f"checks={self.checks}; at least one check is needed")

    @property
    def resolved_device(self) -> str:
        if self.device is not None:
            return self.device
        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def reduced(self) -> bool:
        """Whether shapes are reduced: always on the CPU, never on the GPU."""
        return self.resolved_device == "cpu"

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.precision == "bf16" else torch.float32

    @property
    def warmup_runs(self) -> int:
        if self.warmup is not None:
            return self.warmup
        return 5 if self.resolved_device == "cuda" else 3

    @property
    def timed_runs(self) -> int:
        if self.runs is not None:
            return self.runs
        # The CPU's times swing run to run (other processes, frequency): more runs steady the median.
        return 20 if self.resolved_device == "cuda" else 21


@dataclass
class Check:
    """One comparison of Model and ModelNew on one input."""

    max_abs: float
    allclose: bool
    rel_err: float  # ModelNew vs float64
    ref_rel_err: float  # Model (F.conv2d) vs float64
    limit: float

    @property
    def ok(self) -> bool:
        # Written so that a NaN anywhere fails.
        return self.allclose and self.rel_err <= self.limit


@dataclass
class Result:
    """A case's checks and timings, and what kernelgen compiled on its first call."""

    case: str
    problem: int
    shape: tuple[int, ...]
    precision: str
    device: str
    checks: list[Check] = field(default_factory=list)
    model_ms: float = math.nan
    new_ms: float = math.nan
    compiles: int = 0
    cache_hits: int = 0
    compile_s: float = 0.0  # compiler time on the first call (kernelgen's own count)
    first_call_s: float = 0.0  # the whole first call: compiles, cache loads, the run itself
    error: str | None = None

    @property
    def worst(self) -> Check | None:
        """The check closest to (or furthest past) its limit."""
        if not self.checks:
            return None
        return max(self.checks, key=lambda c: c.rel_err / c.limit if c.rel_err == c.rel_err else math.inf)

    @property
    def max_abs(self) -> float:
        return max((c.max_abs for c in self.checks), default=math.nan)

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.checks) and all(c.ok for c in self.checks)

    @property
    def status(self) -> str:
        return "ERROR" if self.error is not None else ("PASS" if self.ok else "FAIL")

    @property
    def speedup(self) -> float:
        return self.model_ms / self.new_ms if self.new_ms > 0 else math.nan

    def why(self) -> str:
        """What failed, in a line; empty when the case passed."""
        if self.error is not None:
            return self.error
        reasons = []
        for i, c in enumerate(self.checks):
            if not c.allclose:
                reasons.append(f"check {i}: torch.allclose(atol=rtol=1e-2) is False (max abs err {c.max_abs:.3g})")
            if not c.rel_err <= c.limit:
                reasons.append(f"check {i}: rel err {c.rel_err:.3g} > limit {c.limit:.3g}")
        return "; ".join(reasons)


# ---------------------------------------------------------------- loading and inputs

def load_example(path: str | Path) -> ModuleType:
    """Import an example file by path (examples/ is not a package)."""
    path = Path(path)
    name = f"kernelgen_examples.{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def case_name(module: ModuleType) -> str:
    return Path(module.__file__).stem


def problem_shapes(module: ModuleType) -> list[torch.Size]:
    """The shapes get_inputs() produces, found without allocating (on the meta device)."""
    with torch.device("meta"):
        return [t.shape for t in module.get_inputs()]


def reduced_shape(shape: Sequence[int], batch: int, side: int) -> tuple[int, ...]:
    """(N, C, H, W) cut to batch <= `batch`, H and W scaled together to a longer side of `side`."""
    n, c, h, w = shape
    scale = min(1.0, side / max(h, w))
    return (min(n, batch), c, max(1, round(h * scale)), max(1, round(w * scale)))


def input_shapes(module: ModuleType, opts: Options) -> list[tuple[int, ...]]:
    shapes = [tuple(s) for s in problem_shapes(module)]
    if opts.reduced:
        shapes = [reduced_shape(s, opts.reduced_batch, opts.reduced_side) for s in shapes]
    return shapes


def fresh_inputs(module: ModuleType, opts: Options) -> list[torch.Tensor]:
    """New random inputs: the problem's own get_inputs() on the GPU, torch.rand at reduced shapes on the CPU."""
    device = opts.resolved_device
    if opts.reduced:
        xs = [torch.rand(s, device=device) for s in input_shapes(module, opts)]
    else:
        with torch.device(device):  # torch.rand inside get_inputs() allocates there directly
            xs = module.get_inputs()
    return [x.to(opts.dtype) for x in xs]


def build_pair(module: ModuleType, opts: Options) -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]:
    """Model, ModelNew with Model's weights, and Model in float64 (the reference)."""
    init = module.get_init_inputs()
    model = module.Model(*init)
    new = module.ModelNew(*init)
    new.load_state_dict(model.state_dict())
    model = model.to(device=opts.resolved_device, dtype=opts.dtype).eval()
    new = new.to(device=opts.resolved_device, dtype=opts.dtype).eval()
    # From the converted model, so that the reference sees exactly the bf16 weights.
    reference = copy.deepcopy(model).to(torch.float64)
    return model, new, reference


@contextlib.contextmanager
def precision_mode(precision: str):
    """TF32 off for 'ieee', PyTorch's default (on for cuDNN) otherwise; restored afterwards.

    kernelgen (precision=None) follows the same switch, so Model and ModelNew always
    run under one setting.
    """
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    if precision == "ieee":
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    else:
        torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------- checking

def compare(y: torch.Tensor, y_new: torch.Tensor, reference: torch.nn.Module, x: torch.Tensor,
            precision: str) -> Check:
    """Compare Model's output `y` and ModelNew's `y_new` on input `x` (batch-sliced, see REFERENCE_CHUNK_ELEMENTS)."""
    if y_new.shape != y.shape or y_new.dtype != y.dtype:
        raise AssertionError(f"ModelNew returned {tuple(y_new.shape)} {y_new.dtype}; "
                             f"Model returned {tuple(y.shape)} {y.dtype}")
    per_item = max(1, y[0].numel())
    step = max(1, REFERENCE_CHUNK_ELEMENTS // per_item)
    err2 = ref_err2 = norm2 = 0.0
    max_abs = 0.0
    allclose = True
    for start in range(0, y.shape[0], step):
        part = slice(start, start + step)
        y64 = reference(x[part].to(torch.float64))
        a, b = y[part], y_new[part]
        err2 += torch.sum(torch.square(b.to(torch.float64) - y64)).item()
        ref_err2 += torch.sum(torch.square(a.to(torch.float64) - y64)).item()
        norm2 += torch.sum(torch.square(y64)).item()
        max_abs = max(max_abs, (b.to(torch.float64) - a.to(torch.float64)).abs().max().item())
        allclose &= torch.allclose(a, b, atol=KERNELBENCH_ATOL, rtol=KERNELBENCH_RTOL)
        del y64
    norm = math.sqrt(norm2)
    rel_err = math.sqrt(err2) / norm
    ref_rel_err = math.sqrt(ref_err2) / norm
    limit = STRICT_REL_ERR if precision == "ieee" else max(STRICT_REL_ERR, REFERENCE_FACTOR * ref_rel_err)
    return Check(max_abs=max_abs, allclose=allclose, rel_err=rel_err, ref_rel_err=ref_rel_err, limit=limit)


# ---------------------------------------------------------------- timing

def time_pair(fns: Sequence[Callable[[], object]], device: str, warmup: int, runs: int) -> list[float]:
    """Median milliseconds of each function, run alternately (order flipped every round)."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    synchronize(device)
    samples: list[list[float]] = [[] for _ in fns]
    if device == "cuda":
        events = []
        for i in range(runs):
            order = range(len(fns)) if i % 2 == 0 else reversed(range(len(fns)))
            for j in order:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fns[j]()
                end.record()
                events.append((j, start, end))
        torch.cuda.synchronize()
        for j, start, end in events:
            samples[j].append(start.elapsed_time(end))
    else:
        for i in range(runs):
            order = range(len(fns)) if i % 2 == 0 else reversed(range(len(fns)))
            for j in order:
                t0 = time.perf_counter()
                fns[j]()
                samples[j].append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(s) for s in samples]


# ---------------------------------------------------------------- one case

def kernelgen_counters() -> tuple[int, int, float]:
    """(compiles, loads from the disk cache, compile seconds) so far in this process."""
    import kernelgen

    stats = kernelgen.stats()
    return int(stats["compiles"]), int(stats["cache_hits"]), float(stats.get("compile_seconds", 0.0))


def run_case(module: ModuleType, opts: Options) -> Result:
    """Check ModelNew against Model on `opts.checks` fresh inputs, then time both."""
    device = opts.resolved_device
    result = Result(case=case_name(module), problem=int(module.KERNELBENCH_PROBLEM),
                    shape=input_shapes(module, opts)[0], precision=opts.precision, device=device)
    with precision_mode(opts.precision), torch.no_grad():
        model, new, reference = build_pair(module, opts)
        for i in range(opts.checks):
            xs = fresh_inputs(module, opts)
            if len(xs) != 1:
                raise ValueError(f"{result.case}: get_inputs() returned {len(xs)} tensors; the harness compares one")
            y = model(*xs)
            if i == 0:
                # The first call compiles (or loads from the cache) whatever kernelgen needs.
                before = kernelgen_counters()
                t0 = time.perf_counter()
                y_new = new(*xs)
                synchronize(device)
                result.first_call_s = time.perf_counter() - t0
                after = kernelgen_counters()
                result.compiles, result.cache_hits = after[0] - before[0], after[1] - before[1]
                result.compile_s = after[2] - before[2]
            else:
                y_new = new(*xs)
            result.checks.append(compare(y, y_new, reference, xs[0], opts.precision))
            del y, y_new
        del reference
        xs = fresh_inputs(module, opts)
        result.model_ms, result.new_ms = time_pair([lambda: model(*xs), lambda: new(*xs)], device,
                                                   opts.warmup_runs, opts.timed_runs)
    return result


def run_case_safely(module_or_path: ModuleType | Path, opts: Options) -> Result:
    """run_case, but an exception becomes an ERROR result (its traceback goes to stderr)."""
    name = Path(module_or_path).stem if isinstance(module_or_path, Path) else case_name(module_or_path)
    module = None
    try:
        module = load_example(module_or_path) if isinstance(module_or_path, Path) else module_or_path
        return run_case(module, opts)
    except Exception as exc:  # one broken case must not hide the other four
        traceback.print_exc()
        problem = getattr(module, "KERNELBENCH_PROBLEM", 0)
        try:
            shape = input_shapes(module, opts)[0] if module is not None else ()
        except Exception:
            shape = ()
        return Result(case=name, problem=problem, shape=shape, precision=opts.precision,
                      device=opts.resolved_device, error=f"{type(exc).__name__}: {exc}".splitlines()[0])
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# ---------------------------------------------------------------- reporting

def shape_text(shape: Sequence[int]) -> str:
    return "x".join(str(s) for s in shape) if shape else "-"


def compile_line(result: Result) -> str:
    """What the first call cost: kernels compiled, or served from kernelgen's cache."""
    if result.compiles:
        served = f", {result.cache_hits} served from the cache" if result.cache_hits else ""
        return (f"{result.case}: kernelgen compiled {result.compiles} kernel(s) on the first call "
                f"({result.compile_s:.1f} s of compiling, first call {result.first_call_s:.1f} s){served}")
    if result.cache_hits:
        return (f"{result.case}: nothing compiled; served from kernelgen's cache "
                f"({result.cache_hits} kernel(s) loaded, first call {result.first_call_s * 1e3:.0f} ms)")
    return (f"{result.case}: nothing compiled; kernels already loaded in this process "
            f"(first call {result.first_call_s * 1e3:.0f} ms)")


def result_line(result: Result) -> str:
    if result.error is not None:
        return f"{result.case} ({precision_name(result)}, {result.device}): ERROR: {result.error}"
    worst = result.worst
    return (f"{result.case} (KernelBench 1/{result.problem}, {shape_text(result.shape)}, {precision_name(result)}, "
            f"{result.device}): max abs err {result.max_abs:.2e}, rel err {worst.rel_err:.2e} "
            f"(F.conv2d {worst.ref_rel_err:.2e}, limit {worst.limit:.1e}), "
            f"allclose {'yes' if all(c.allclose for c in result.checks) else 'NO'}; "
            f"Model {result.model_ms:.3f} ms, ModelNew {result.new_ms:.3f} ms, "
            f"speedup {result.speedup:.2f}x: {result.status}")


def precision_name(result: Result) -> str:
    """The precision a result ran in, as its line names it: 'tf32' means TF32 allowed, which the
    CPU has none of, so there it ran plain float32."""
    return "float32" if result.device == "cpu" and result.precision == "tf32" else result.precision


def heading(opts: Options) -> str:
    device = opts.resolved_device
    if device == "cuda":
        where = f"{torch.cuda.get_device_name()}, problem shapes"
        timer = "CUDA events"
    else:
        why = "no CUDA device" if not torch.cuda.is_available() else "--device cpu"
        where = (f"CPU path ({why}): reduced shapes (batch <= {opts.reduced_batch}, "
                 f"longer side {opts.reduced_side})")
        timer = "time.perf_counter"
        where += ("\nThe CPU path is for correctness and portability (no GPU needed); its times beside "
                  "F.conv2d (oneDNN) are shown, not tuned for")
    label = PRECISION_LABELS[opts.precision]
    if device == "cpu" and opts.precision == "tf32":
        label = "float32 (TF32 does not apply on the CPU)"
    return (f"KernelBench level 1: Model (PyTorch) vs ModelNew (kernelgen) -- {label} -- {where}\n"
            f"torch {torch.__version__}; {opts.checks} checks per case; "
            f"median of {opts.timed_runs} runs after {opts.warmup_runs} warm-up ({timer})")


TABLE_COLUMNS = ("case", "input", "max abs err", "rel err vs fp64", "F.conv2d rel err", "limit",
                 "Model ms", "ModelNew ms", "speedup", "result")


def table_rows(results: Sequence[Result]) -> list[tuple[str, ...]]:
    rows = []
    for r in results:
        label = f"{r.problem} {r.case}" if r.problem else r.case
        if r.error is not None or not r.checks:
            rows.append((label, shape_text(r.shape)) + ("-",) * 7 + (r.status,))
            continue
        w = r.worst
        rows.append((label, shape_text(r.shape), f"{r.max_abs:.2e}", f"{w.rel_err:.2e}", f"{w.ref_rel_err:.2e}",
                     f"{w.limit:.1e}", f"{r.model_ms:.3f}", f"{r.new_ms:.3f}", f"{r.speedup:.2f}x", r.status))
    return rows


def table(results: Sequence[Result], opts: Options) -> str:
    rows = [TABLE_COLUMNS] + table_rows(results)
    widths = [max(len(row[i]) for row in rows) for i in range(len(TABLE_COLUMNS))]
    numeric = set(range(2, 9))

    def fmt(row: Sequence[str]) -> str:
        cells = [cell.rjust(w) if i in numeric else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        return "| " + " | ".join(cells) + " |"

    lines = [heading(opts), "", fmt(rows[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += [fmt(row) for row in rows[1:]]
    failures = [f"  {r.case}: {r.why()}" for r in results if not r.ok]
    if failures:
        lines += ["", "failures:"] + failures
    return "\n".join(lines)


def compile_summary(results: Sequence[Result]) -> str:
    if not any(r.checks for r in results):
        return "kernelgen: no case ran far enough to load a kernel."
    compiles = sum(r.compiles for r in results)
    hits = sum(r.cache_hits for r in results)
    seconds = sum(r.compile_s for r in results)
    if compiles:
        return (f"kernelgen: compiled {compiles} kernel(s) in {seconds:.1f} s on first use; "
                f"{hits} served from the cache")
    return f"kernelgen: nothing compiled; all {hits} kernel(s) served from the cache."


# ---------------------------------------------------------------- command line

def parse_args(argv: Sequence[str] | None, description: str) -> Options:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--precision", choices=PRECISIONS, default="tf32",
                        help="ieee: float32 with TF32 off; tf32: float32, PyTorch's default (TF32 allowed "
                             "for cuDNN); bf16: model and inputs in bfloat16 (default: %(default)s)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="default: cuda when available; the CPU path runs at reduced shapes")
    parser.add_argument("--checks", type=int, default=3, help="fresh random inputs compared (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up runs (default: 5 on CUDA, 1 on the CPU)")
    parser.add_argument("--runs", type=int, default=None, help="timed runs (default: 20 on CUDA, 5 on the CPU)")
    args = parser.parse_args(argv)
    try:
        return Options(precision=args.precision, device=args.device, checks=args.checks,
                       warmup=args.warmup, runs=args.runs)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def show_compiles() -> None:
    """Let kernelgen's INFO log (each compile: spec and seconds) reach the terminal.

    Done here, in the scripts, never in the library: a library does not set levels.
    """
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # kernelgen prefixes its own lines
    logging.getLogger("kernelgen").setLevel(logging.INFO)


def require_kernelgen() -> None:
    """Exit with the set-up step when kernelgen cannot be imported."""
    if importlib.util.find_spec("kernelgen") is None:
        sys.exit("kernelgen is not importable: from the repository root run `python -m pip install -e .` "
                 "(or set PYTHONPATH to the repository root) and try again")


def main(module: ModuleType, argv: Sequence[str] | None = None) -> int:
    """Entry point of one example: check, time, print one line of results."""
    opts = parse_args(argv, description=(module.__doc__ or "").strip().splitlines()[0])
    show_compiles()
    result = run_case(module, opts)
    print(compile_line(result))
    print(result_line(result))
    if not result.ok:
        print(f"  {result.why()}")
    return 0 if result.ok else 1
