"""How fast kernelgen's machinery is: cold compiles, warm starts, per-call overhead, parallel builds.

    python benchmarks/bench_machinery.py [--json out.json] [--jobs 16]

Targets (kernelgen issue 2): a cold compile of one specialisation <= 10 s (median); a
fresh process calling a cached spec <= 5 ms on top of `import torch`; host overhead per
call on a tiny convolution no more than torch's, side by side, in every call form (positional,
tuples, keywords, 'same', a module's forward with and without grad, a fused epilogue against
torch's conv, add and relu). Runs on the GPU when there is one, else on the CPU path (and says
so).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import kernelgen  # noqa: E402
from kernelgen import kernels  # noqa: E402
from kernelgen.functional import clear_plans, spec_for  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Specs meant to reach each family the device has, with kernels of the sizes the cases use.
# Labels name the problem, not a family: the dispatcher picks the family (printed beside
# the label), and its choice moves (5x7 builds wgmma on sm_90a, igemm before Hopper).
COLD = [  # (label, input shape, weight shape, kwargs)
    ("3x3 C_in=3", (1, 3, 32, 32), (8, 3, 3, 3), dict(padding=1)),
    ("depthwise 3x3", (1, 32, 32, 32), (32, 1, 3, 3), dict(groups=32, padding=1)),
    ("pointwise 1x1", (1, 64, 32, 32), (128, 64, 1, 1), dict()),
    ("dense 3x3", (1, 16, 32, 32), (128, 16, 3, 3), dict()),
    ("dense 5x7", (1, 64, 32, 32), (128, 64, 5, 7), dict()),
]
WARM_RUNS = 20  # fresh processes; one process's time moves by a millisecond or more

WARM_CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {repo!r})
    import torch
    dev = {device!r}
    x = torch.randn(1, 3, 32, 32, device=dev); w = torch.randn(8, 3, 3, 3, device=dev)
    if dev == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    import kernelgen
    y = kernelgen.conv2d(x, w, padding=1)
    if dev == "cuda":
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    assert kernelgen.stats()["compiles"] == 0, "the spec was not cached"
    print(t1 - t0)
""")


def cold_compiles(root: Path) -> list[dict]:
    os.environ["KERNELGEN_CACHE_DIR"] = str(root)
    kernels.clear_memo()
    clear_plans()
    out = []
    for label, xs, ws, kw in COLD:
        x, w = torch.randn(*xs, device=DEVICE), torch.randn(*ws, device=DEVICE)
        spec, _ = spec_for(x, w, None, **kw)
        before = kernels.stats()["compile_seconds"]
        t0 = time.perf_counter()
        kernelgen.conv2d(x, w, **kw)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        out.append(dict(label=label, family=spec.family, first_call_s=time.perf_counter() - t0,
                        compile_s=kernels.stats()["compile_seconds"] - before))
    return out


def warm_start(root: Path, runs: int = WARM_RUNS) -> list[float]:
    """Fresh processes calling a cached spec: import kernelgen + first call, after `import torch`.

    The package is byte-compiled first, as `pip install` does: a checkout without .pyc
    files pays for compiling kernelgen's sources in every process, which an installed
    kernelgen never does.
    """
    import compileall

    compileall.compile_dir(str(REPO / "kernelgen"), quiet=1)
    env = dict(os.environ, KERNELGEN_CACHE_DIR=str(root))
    script = WARM_CHILD.format(repo=str(REPO), device=DEVICE)
    subprocess.run([sys.executable, "-c", script.replace('assert kernelgen.stats()["compiles"] == 0, '
                                                         '"the spec was not cached"', "")],
                   env=env, check=True, capture_output=True)  # make sure it is cached
    times = []
    for _ in range(runs):
        r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(r.stderr)
        times.append(float(r.stdout.strip().splitlines()[-1]))
    return times


def call_forms() -> dict[str, tuple]:
    """{form: (kernelgen's call, torch's call)} of one tiny convolution in each way a user makes it:
    positional ints, tuples, keywords, 'same', a module's forward (no_grad, and with its parameters
    requiring grad, as a training forward runs), and a fused epilogue (torch: conv, add, relu)."""
    x = torch.randn(1, 4, 8, 8, device=DEVICE)
    w = torch.randn(4, 4, 3, 3, device=DEVICE)
    b = torch.randn(4, device=DEVICE)
    r = torch.randn(1, 4, 8, 8, device=DEVICE)
    mk = kernelgen.Conv2d(4, 4, 3, padding=1).to(DEVICE)
    mt = torch.nn.Conv2d(4, 4, 3, padding=1).to(DEVICE)

    def no_grad(m):
        def call():
            with torch.no_grad():
                return m(x)
        return call

    return {
        "positional": (lambda: kernelgen.conv2d(x, w, b, 1, 1), lambda: F.conv2d(x, w, b, 1, 1)),
        "tuples": (lambda: kernelgen.conv2d(x, w, b, (1, 1), (1, 1), (1, 1)),
                   lambda: F.conv2d(x, w, b, (1, 1), (1, 1), (1, 1))),
        "keywords": (lambda: kernelgen.conv2d(x, w, b, stride=1, padding=1), lambda: F.conv2d(x, w, b, stride=1, padding=1)),
        "same": (lambda: kernelgen.conv2d(x, w, b, padding="same"), lambda: F.conv2d(x, w, b, padding="same")),
        "module": (no_grad(mk), no_grad(mt)),
        "module, grad": (lambda: mk(x), lambda: mt(x)),
        "relu(conv + r)": (lambda: kernelgen.conv2d(x, w, b, padding=1, activation="relu", residual=r),
                           lambda: F.relu(F.conv2d(x, w, b, padding=1) + r)),
    }


def host_overhead(calls: int = 3000) -> dict:
    """{form: {'kernelgen', 'torch': median host microseconds a call}} (call_forms), the two taking
    turns; on a GPU the time to issue the calls (the GPU may lag behind)."""
    out = {}
    for form, fns in call_forms().items():
        for fn in fns:
            for _ in range(50):
                fn()
        samples: list[list[float]] = [[], []]
        for _ in range(5):  # interleave, so drift affects both alike
            for i, fn in enumerate(fns):
                if DEVICE == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                t1 = time.perf_counter()
                if DEVICE == "cuda":
                    torch.cuda.synchronize()
                samples[i].append((t1 - t0) / calls * 1e6)
        out[form] = dict(kernelgen=statistics.median(samples[0]), torch=statistics.median(samples[1]))
    return out


def parallel_builds(root: Path, jobs: int) -> dict:
    from kernelgen.warm import warm_specs

    specs = []
    for k in range(jobs):
        x = torch.empty(1, 8 + k, 20, 20, device="meta")
        w = torch.empty(16, 8 + k, 3, 3, device="meta")
        specs.append(spec_for(x, w, None, padding=1, device=DEVICE)[0])
    os.environ["KERNELGEN_CACHE_DIR"] = str(root)
    t0 = time.perf_counter()
    results = warm_specs(specs, jobs=jobs)
    wall = time.perf_counter() - t0
    return dict(specs=len(specs), jobs=jobs, wall_s=wall, sum_build_s=sum(r.seconds for r in results),
                built=sum(r.status == "built" for r in results), failed=sum(r.status == "failed" for r in results))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kg-bench-") as tmp:
        tmp = Path(tmp)
        cold = cold_compiles(tmp / "cold")
        warm = warm_start(tmp / "cold")
        overhead = host_overhead()
        par = parallel_builds(tmp / "par", args.jobs)
    cold_median = statistics.median(r["compile_s"] for r in cold)
    warm_median = statistics.median(warm) * 1e3
    warm_q1, _, warm_q3 = (q * 1e3 for q in statistics.quantiles(warm, n=4))
    print(f"# machinery on {torch.cuda.get_device_name() if DEVICE == 'cuda' else 'the CPU path (no CUDA device)'}")
    for r in cold:
        print(f"cold compile  {r['label']:14} ({r['family']:9}): compile {r['compile_s']:5.2f} s, first call "
              f"{r['first_call_s']:5.2f} s")
    print(f"cold compile median: {cold_median:.2f} s (target <= 10 s): {'ok' if cold_median <= 10 else 'MISS'}")
    print(f"fresh process, cached spec, import kernelgen + first call: median {warm_median:.2f} ms of {len(warm)} "
          f"processes (quartiles {warm_q1:.2f}-{warm_q3:.2f}, range {min(warm) * 1e3:.2f}-{max(warm) * 1e3:.2f}) "
          f"(target <= 5 ms): {'ok' if warm_median <= 5 else 'MISS'}")
    for form, us in overhead.items():
        print(f"host time per call, tiny conv, {form:15}: kernelgen {us['kernelgen']:5.1f} us, torch "
              f"{us['torch']:5.1f} us ({us['kernelgen'] / us['torch']:.2f}x; target <= 1): "
              f"{'ok' if us['kernelgen'] <= us['torch'] else 'MISS'}")
    print(f"parallel builds: {par['specs']} specs with {par['jobs']} jobs in {par['wall_s']:.1f} s wall "
          f"({par['sum_build_s']:.1f} s of builds; {par['built']} built, {par['failed']} failed)")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(cold=cold, cold_median_s=cold_median, warm_start_s=warm,
                                                   host_overhead_us=overhead, parallel=par), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
