"""The five KernelBench cases (and a ResNet stem) in every precision: kernelgen beside F.conv2d, on one GPU.

    python benchmarks/bench_cases.py [--json out.json] [--cases 87,56] [--precisions tf32,ieee,bf16]

For each case and precision (float32 with TF32 allowed, strict float32, bfloat16) it
times kernelgen.conv2d and F.conv2d in this process (medians of CUDA-event-timed runs
after warm-up, taken in alternating rounds, everything conv2d does per call included),
measures the card's copy
bandwidth and GEMM peaks to compute each case's floor (for strict float32 on tensor cores,
the 3xTF32 it runs: three TF32 products a multiply-add), and checks accuracy against
float64 per docs/performance.md's accuracy rules. Accuracy is measured on the first two images of the
batch (errors are per image; the float64 reference of a whole batch of case 63 would
need 17 GB); every output element of the timed call is checked to be finite.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kernelgen  # noqa: E402
from kernelgen.families import get_family  # noqa: E402


@dataclass(frozen=True)
class Case:
    name: str
    N: int
    C: int
    K: int
    H: int
    W: int
    kernel: tuple[int, int]
    groups: int = 1
    stride: int = 1
    padding: int = 0


CASES = {
    "87": Case("87 pointwise", 16, 64, 128, 1024, 1024, (1, 1)),
    "56": Case("56 asymmetric", 8, 64, 128, 512, 256, (5, 7)),
    "63": Case("63 square", 16, 16, 128, 1024, 1024, (3, 3)),
    "84": Case("84 depthwise", 64, 128, 128, 256, 512, (3, 3), groups=128),
    "83": Case("83 depthwise kx1", 64, 8, 8, 512, 512, (3, 1), groups=8),
    # Beyond the five: a ResNet stem (3 channels, 7x7, stride 2), which has no target of its own;
    # it is met when it keeps its accuracy and beats F.conv2d.
    "stem": Case("stem 7x7 stride 2", 32, 3, 64, 224, 224, (7, 7), stride=2, padding=3),
}

# Targets in ms on the H100 (the project's performance notes).
TARGETS = {
    "87": {"tf32": 4.50, "ieee": 5.5, "bf16": 2.4},
    "56": {"tf32": 1.90, "ieee": 13.0, "bf16": 1.2},
    "63": {"tf32": 3.70, "ieee": 10.0, "bf16": 2.0},
    "84": {"tf32": 3.20, "ieee": 3.20, "bf16": 1.6},
    "83": {"tf32": 0.42, "ieee": 0.42, "bf16": 0.21},
}


def _timed(fn, reps: int, times: list[float], cuda: bool = True) -> None:
    """Appends the time of each of `reps` runs of fn, in ms: between CUDA events, or by the host
    clock where `cuda` is False (the CPU path)."""
    for _ in range(reps):
        if not cuda:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))


def event_ms(fn, warmup: int = 10, reps: int = 40) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times: list[float] = []
    _timed(fn, reps, times)
    return statistics.median(times)


def rounds_ms(*fns, rounds: int = 3, reps: int = 15, warmup: int = 10, cuda: bool = True) -> list[float]:
    """Each function's median time in ms over `rounds` rounds of `reps` timed runs, the functions
    taking turns round by round (a, b, c, a, b, c, ...) so that a drift of the card's clocks or
    memory over the measurement hits all alike; `warmup` untimed runs of each first."""
    for f in fns:
        for _ in range(warmup):
            f()
    if cuda:
        torch.cuda.synchronize()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for f, t in zip(fns, times):
            _timed(f, reps, t, cuda)
    return [statistics.median(t) for t in times]


def paired_ms(fa, fb, rounds: int = 3, reps: int = 15) -> tuple[float, float]:
    """Medians of event-timed runs of fa and fb, taken in alternating rounds (rounds_ms).
    One round each once measured case 83's kernel 10% slower than the same kernel a row later."""
    a, b = rounds_ms(fa, fb, rounds=rounds, reps=reps)
    return a, b


def ceilings() -> dict[str, float]:
    """Measured copy bandwidth (bytes read + written per second) and GEMM peaks (FLOP/s)."""
    out = {}
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = event_ms(lambda: b.copy_(a), reps=10)
    out["copy_Bps"] = 2 * a.numel() / (ms * 1e-3)
    del a, b
    n = 8192
    for name, dtype, tf32 in (("tf32", torch.float32, True), ("ieee", torch.float32, False),
                              ("bf16", torch.bfloat16, False)):
        x = torch.randn(n, n, device="cuda", dtype=dtype)
        y = torch.randn(n, n, device="cuda", dtype=dtype)
        prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        ms = event_ms(lambda: x @ y, warmup=2, reps=5)
        torch.backends.cuda.matmul.allow_tf32 = prev
        out[f"{name}_flops"] = 2 * n ** 3 / (ms * 1e-3)
    return out


def rel_err(y, ref) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


def tf32_round(t: torch.Tensor) -> torch.Tensor:
    """float32 rounded to TF32's 10-bit mantissa, to nearest (ties away from zero)."""
    bits = t.float().contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def set_tf32(allowed: bool) -> None:
    torch.backends.cudnn.allow_tf32 = allowed
    torch.backends.cuda.matmul.allow_tf32 = allowed


def run_case(key: str, precision: str, peaks: dict[str, float]) -> dict:
    c = CASES[key]
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    set_tf32(precision != "ieee")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.rand(c.N, c.C, c.H, c.W, device="cuda", generator=g).to(dtype)
    w = (torch.rand(c.K, c.C // c.groups, *c.kernel, device="cuda", generator=g) - 0.5).to(dtype)
    kw = dict(stride=c.stride, padding=c.padding, groups=c.groups)

    y = kernelgen.conv2d(x, w, **kw)  # compiles on first use, outside the timing
    finite = bool(torch.isfinite(y).all())
    kg_ms, torch_ms = paired_ms(lambda: kernelgen.conv2d(x, w, **kw), lambda: F.conv2d(x, w, **kw))

    xs = x[:2]
    ref = F.conv2d(xs.double(), w.double(), **kw)
    kg_err = rel_err(y[:2], ref)
    torch_err = rel_err(F.conv2d(xs, w, **kw), ref)
    if precision == "ieee":
        bound, rule = 1e-5, "<= 1e-5"
    elif precision == "tf32" and key not in TARGETS:
        # cuDNN computes the stem in full float32 even with TF32 allowed, so its error is no TF32
        # error to compare with: the bar is TF32's own, the exact convolution of the operands
        # rounded to TF32 (nearest, as cvt.rna does).
        tf32_err = rel_err(F.conv2d(tf32_round(xs).double(), tf32_round(w).double(), **kw), ref)
        bound, rule = 1.5 * max(torch_err, tf32_err), "<= 1.5x TF32 rounding's"
    else:
        bound, rule = 1.5 * torch_err, "<= 1.5x F.conv2d's"
    del y

    P = (c.H + 2 * c.padding - c.kernel[0]) // c.stride + 1
    Q = (c.W + 2 * c.padding - c.kernel[1]) // c.stride + 1
    flops = 2 * c.N * c.K * P * Q * (c.C // c.groups) * c.kernel[0] * c.kernel[1]
    elt = x.element_size()
    nbytes = elt * (x.numel() + w.numel() + c.N * c.K * P * Q)
    spec = kernelgen.functional.spec_for(x, w, None, **kw)[0]
    # The floor of the math the kernel runs: strict float32 on tensor cores is 3xTF32, three TF32
    # products per multiply-add (the depthwise family's exact FFMAs run at the FP32 peak).
    if precision == "ieee" and get_family(spec.family).tf32:  # the tensor-core families
        math, compute_s = "3xtf32", 3 * flops / peaks["tf32_flops"]
    else:
        math, compute_s = precision, flops / peaks[f"{precision}_flops"]
    floor_ms = max(nbytes / peaks["copy_Bps"], compute_s) * 1e3
    target = TARGETS.get(key, {}).get(precision)
    accurate = finite and kg_err <= bound
    return dict(case=c.name, precision=precision, kernelgen_ms=kg_ms, torch_ms=torch_ms, speedup=torch_ms / kg_ms,
                floor_ms=floor_ms, floor_math=math, pct_of_floor=100 * floor_ms / kg_ms, rel_err=kg_err,
                torch_rel_err=torch_err,
                accuracy_rule=rule, accurate=accurate, target_ms=target,
                met=accurate and (target is None or kg_ms <= target) and kg_ms <= torch_ms, family=spec.family,
                spec=spec.summary())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--precisions", default="tf32,ieee,bf16")
    ap.add_argument("--json", help="write the results here as JSON")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_cases.py needs a CUDA device", file=sys.stderr)
        return 2
    peaks = ceilings()
    print(f"# {torch.cuda.get_device_name()}: copy {peaks['copy_Bps'] / 1e12:.2f} TB/s, TF32 "
          f"{peaks['tf32_flops'] / 1e12:.0f}, FP32 {peaks['ieee_flops'] / 1e12:.0f}, bf16 "
          f"{peaks['bf16_flops'] / 1e12:.0f} TFLOP/s; torch {torch.__version__}")
    rows = []
    for key in args.cases.split(","):
        for precision in args.precisions.split(","):
            try:
                row = run_case(key, precision, peaks)
            except Exception as exc:  # one broken case must not hide the others' numbers
                row = dict(case=CASES[key].name, precision=precision, error=f"{type(exc).__name__}: {exc}"[:500])
            rows.append(row)
            torch.cuda.empty_cache()
    set_tf32(True)
    header = (f"| {'case':18} | prec | kernelgen ms | F.conv2d ms | speedup | % floor | rel err (rule) | target ms | met | family |")
    print(header)
    print("|" + "|".join("-" * (len(part)) for part in header.split("|")[1:-1]) + "|")
    for r in rows:
        if "error" in r:
            print(f"| {r['case']:18} | {r['precision']:4} | ERROR {r['error'][:150]}")
            continue
        print(f"| {r['case']:18} | {r['precision']:4} | {r['kernelgen_ms']:12.3f} | {r['torch_ms']:11.3f} | "
              f"{r['speedup']:6.2f}x | {r['pct_of_floor']:6.1f}% | {r['rel_err']:.2e} ({r['accuracy_rule']}: "
              f"{'ok' if r['accurate'] else 'FAIL'}) | "
              f"{'-' if r['target_ms'] is None else format(r['target_ms'], '.2f'):>9} | {'yes' if r['met'] else 'no':3} | "
              f"{r['family']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                                   ceilings=peaks, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
