"""Seeded fuzzing of kernelgen.conv2d against F.conv2d on the CPU (issue 54); run by tests/test_fuzz.py.

    python tests/fuzz_conv.py --cases 500 --seed 54 --jobs 2 --json counts.json

Each case is a random call: shapes, dtypes, views (the negative and conjugate bits, slices, expands,
zero strides, offsets, channels_last), empty batches, meta tensors, and hostile or oddly typed
parameters (huge and negative integers, bools, floats, strings, tensors, wrong-length tuples). It
runs in a process of its own, forked from this one (torch imported once, nothing computed here, so
the child's OpenMP starts clean), so a crash is a counted failure rather than the end of the run.

Outcomes: agree (same values within the dtype's tolerance of a float64 reference, same shape, dtype
and memory format), both_raise, kernelgen_only_raise, torch_only_raise, wrong, crashed (killed by a
signal, or hung past the case limit).

The kernels a run compiles are bounded: every call draws its convolution from a small pool of
parameter sets (one compile each, per dtype), and varies what does not change the kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's kernelgen

OUTCOMES = ("agree", "both_raise", "kernelgen_only_raise", "torch_only_raise", "wrong", "crashed")
TOL = {"float64": 1e-11, "float32": 2e-5, "bfloat16": 3e-2, "float16": 5e-3}

# (C, K, kh, kw, groups, stride, padding, dilation, bias, dtype): the convolutions a run compiles.
POOL = [
    (3, 4, 3, 3, 1, 1, 1, 1, True, "float32"),
    (4, 6, 1, 1, 1, 1, 0, 1, False, "float32"),
    (6, 6, 3, 3, 6, 1, 1, 1, True, "float32"),            # depthwise
    (4, 8, 2, 3, 2, (2, 1), (0, 1), (1, 2), False, "float32"),
    (4, 4, 4, 4, 1, 1, "same", 1, True, "float32"),       # even kernel, 'same'
    (2, 3, 3, 1, 1, 3, "valid", 1, False, "float32"),
    (3, 5, 3, 3, 1, 2, 2, 2, True, "float64"),
    (4, 4, 3, 3, 2, 1, 1, 1, False, "float64"),
    (3, 4, 3, 3, 1, 1, 1, 1, True, "bfloat16"),
    (4, 8, 1, 1, 4, 1, 0, 1, True, "bfloat16"),
    (3, 4, 3, 3, 1, 1, 1, 1, False, "float16"),
    (2, 4, 5, 5, 2, 2, 2, 1, True, "float16"),
]
HUGE_STRIDE_POOL = 3  # pool entries a huge stride is tried on (it compiles a kernel of its own)

INPUT_VIEWS = ("contiguous", "contiguous", "channels_last", "neg", "conj_imag", "channel_slice", "batch_slice",
               "spatial_step", "expand_batch", "zero_stride_w", "offset", "transposed")
WEIGHT_VIEWS = ("contiguous", "contiguous", "channels_last", "neg", "slice", "expand", "transposed")
BIAS_VIEWS = ("contiguous", "neg", "strided")


def _hostile(name: str, value, rng: random.Random):
    """An odd or hostile stand-in for a parameter: same value, other type; or a value torch refuses."""
    import torch

    same = [lambda v: torch.tensor(v) if isinstance(v, int) else v, lambda v: [v] if isinstance(v, int) else v,
            lambda v: (v,) if isinstance(v, int) else v]
    try:
        import numpy

        same.append(lambda v: numpy.int64(v) if isinstance(v, int) else v)
    except ImportError:
        pass
    bad = {
        "stride": [2**63, 2**64, -1, 0, True, 1.5, "2", (1, 1, 1), [], -2**63, None],
        "padding": [-1, 2**31, 2**62, 2**63, "full", (1, 1, 1), 1.0, -2**31],
        "dilation": [0, -1, 2**40, 2**63, 2**31, (1, 2, 3), 0.5],
        "groups": [0, -1, 2**63, 5, True, 1.0, "1"],
    }[name]
    if rng.random() < 0.4:
        return rng.choice(same)(value)
    return rng.choice(bad)


def make_cases(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        p = rng.randrange(len(POOL))
        C, K, kh, kw, groups, stride, padding, dilation, bias, dtype = POOL[p]
        case = dict(idx=i, seed=rng.randrange(2**31), pool=p, C=C, K=K, kh=kh, kw=kw, dtype=dtype,
                    N=rng.choice([0, 1, 1, 2, 3]), unbatched=rng.random() < 0.1,
                    H=rng.randint(1, 12), W=rng.randint(1, 12), bias=bias and rng.random() < 0.8,
                    params=dict(stride=stride, padding=padding, dilation=dilation, groups=groups),
                    xview=rng.choice(INPUT_VIEWS), wview=rng.choice(WEIGHT_VIEWS), bview=rng.choice(BIAS_VIEWS),
                    meta=rng.random() < 0.04)
        r = rng.random()
        if r < 0.25:
            name = rng.choice(["stride", "padding", "dilation", "groups"])
            case["params"][name] = ("hostile", name)
        elif r < 0.28 and p < HUGE_STRIDE_POOL:  # a stride past the input: one window, as torch computes it
            case["params"]["stride"] = rng.choice([2**31, 2**32, 2**63 - 1, (2**31, 1)])
            case["H"] = case["W"] = 6
        elif r < 0.30:  # channels or kernel that do not match: both must raise
            case["C"] += rng.choice([-1, 1]) if case["C"] > 1 else 1
        cases.append(case)
    return cases


def _input(case, torch, g):
    N, C, H, W = case["N"], case["C"], case["H"], case["W"]
    dt = getattr(torch, case["dtype"])
    rnd = lambda *s: torch.randn(*s, generator=g).to(dt)  # noqa: E731
    v = case["xview"]
    if v == "channels_last":
        x = rnd(N, C, H, W).contiguous(memory_format=torch.channels_last)
    elif v == "neg":
        x = torch._neg_view(-rnd(N, C, H, W))
    elif v == "conj_imag" and dt in (torch.float32, torch.float64):
        cdt = torch.complex64 if dt == torch.float32 else torch.complex128
        x = torch.randn(N, C, H, W, generator=g, dtype=cdt).conj().imag
    elif v == "channel_slice":
        x = rnd(N, 2 * C, H, W)[:, C:]
    elif v == "batch_slice":
        x = rnd(N + 2, C, H, W)[1:N + 1]
    elif v == "spatial_step":
        x = rnd(N, C, 2 * H, 2 * W)[..., ::2, ::2]
    elif v == "expand_batch":
        x = rnd(1, C, H, W).expand(N, C, H, W)
    elif v == "zero_stride_w":
        x = rnd(N, C, H, 1).expand(N, C, H, W)
    elif v == "offset":
        x = rnd(N * C * H * W + 3)[3:].view(N, C, H, W)
    elif v == "transposed":
        x = rnd(N, C, W, H).transpose(2, 3)
    else:
        x = rnd(N, C, H, W)
    return x[0] if case["unbatched"] and N > 0 else x


def _weight(case, torch, g):
    K, kh, kw = case["K"], case["kh"], case["kw"]
    groups = POOL[case["pool"]][4]
    cg = POOL[case["pool"]][0] // groups  # the pool's weight: a changed C must not match it
    dt = getattr(torch, case["dtype"])
    rnd = lambda *s: torch.randn(*s, generator=g).to(dt)  # noqa: E731
    v = case["wview"]
    if v == "channels_last":
        return rnd(K, cg, kh, kw).contiguous(memory_format=torch.channels_last)
    if v == "neg":
        return torch._neg_view(-rnd(K, cg, kh, kw))
    if v == "slice":
        return rnd(2 * K, cg, kh, kw)[K:]
    if v == "expand":
        return rnd(1, cg, kh, kw).expand(K, cg, kh, kw)
    if v == "transposed":
        return rnd(K, cg, kw, kh).transpose(2, 3)
    return rnd(K, cg, kh, kw)


def _bias(case, torch, g):
    if not case["bias"]:
        return None
    dt = getattr(torch, case["dtype"])
    K = case["K"]
    v = case["bview"]
    if v == "neg":
        return torch._neg_view(-torch.randn(K, generator=g).to(dt))
    if v == "strided":
        return torch.randn(2 * K, generator=g).to(dt)[::2]
    return torch.randn(K, generator=g).to(dt)


def run_case(case: dict) -> dict:
    """One call, compared; runs in the forked child."""
    import torch
    import torch.nn.functional as F

    import kernelgen
    from kernelgen.errors import KernelgenError

    import warnings

    warnings.filterwarnings("ignore")  # (torch's notes on 'same' padding and the like)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(case["seed"])
    rng = random.Random(case["seed"])
    x, w, b = _input(case, torch, g), _weight(case, torch, g), _bias(case, torch, g)
    params = {}
    for k, v in case["params"].items():
        params[k] = _hostile(v[1], POOL[case["pool"]][("stride", "padding", "dilation", "groups").index(k) + 5], rng) \
            if isinstance(v, tuple) and v[:1] == ("hostile",) else v
    if case["meta"]:
        x, w = x.to("meta"), w.to("meta")
        b = None if b is None else b.to("meta")
    out = {"idx": case["idx"], "call": {k: repr(v)[:60] for k, v in params.items()},
           "x": [list(x.shape), list(x.stride()), case["xview"]], "w": [list(w.shape), case["wview"]],
           "dtype": case["dtype"]}
    try:
        ref = F.conv2d(x, w, b, **params)
        theirs = None
    except Exception as exc:  # noqa: BLE001 (whatever torch raises is an outcome)
        ref, theirs = None, f"{type(exc).__name__}: {str(exc)[:200]}"
    try:
        y = kernelgen.conv2d(x, w, b, **params)
        ours = None
    except Exception as exc:  # noqa: BLE001
        y, ours = None, f"{type(exc).__name__}: {str(exc)[:200]}"
        out["deliberate"] = isinstance(exc, (KernelgenError, TypeError))
        if not out["deliberate"]:
            out["trace"] = traceback.format_exc()[-1500:]
    out["torch"], out["kernelgen"] = theirs, ours
    if theirs and ours:
        out["outcome"] = "both_raise"
    elif ours:
        out["outcome"] = "kernelgen_only_raise"
    elif theirs:
        out["outcome"] = "torch_only_raise"
    else:
        out["outcome"] = _compare(y, ref, x, w, b, params, torch, F, case["dtype"], out)
    return out


def _compare(y, ref, x, w, b, params, torch, F, dtype, out) -> str:
    cl = torch.channels_last
    if y.shape != ref.shape or y.dtype != ref.dtype or y.device != ref.device:
        out["why"] = f"shape/dtype {tuple(y.shape)} {y.dtype} vs {tuple(ref.shape)} {ref.dtype}"
        return "wrong"
    if y.numel() and (y.is_contiguous() != ref.is_contiguous()
                      or y.is_contiguous(memory_format=cl) != ref.is_contiguous(memory_format=cl)):
        out["why"] = f"memory format: strides {y.stride()} vs {ref.stride()}"
        return "wrong"
    if y.is_meta or y.numel() == 0:
        return "agree"
    r64 = F.conv2d(x.double(), w.double(), None if b is None else b.double(), **params)
    diff = (y.double() - r64).norm().item()
    scale = r64.norm().item()
    err = diff / scale if scale > 0 else diff
    out["err"] = err
    if not err <= TOL[dtype]:
        out["why"] = f"relative error {err:.3g} > {TOL[dtype]}"
        return "wrong"
    return "agree"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=500)
    ap.add_argument("--seed", type=int, default=54)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--case-timeout", type=float, default=120.0)
    ap.add_argument("--deadline", type=float, default=600.0, help="stop starting cases after this many seconds")
    ap.add_argument("--json", help="write the counts and the non-agreeing cases here")
    args = ap.parse_args(argv)

    import torch  # noqa: F401 (imported once, before forking; nothing is computed in this process)

    import kernelgen  # noqa: F401

    cases = make_cases(args.cases, args.seed)
    results: dict[int, dict] = {}
    running: dict[int, tuple[int, float, str]] = {}  # pid -> (case index, start, result file)
    start = time.monotonic()
    pending = list(cases)
    with tempfile.TemporaryDirectory(prefix="kg-fuzz-") as tmp:
        while pending or running:
            while pending and len(running) < args.jobs and time.monotonic() - start < args.deadline:
                case = pending.pop(0)
                path = os.path.join(tmp, f"{case['idx']}.json")
                pid = os.fork()
                if pid == 0:  # the child: one case, its result in a file, never back into the loop
                    code = 0
                    try:
                        res = run_case(case)
                        with open(path + ".part", "w") as f:
                            json.dump(res, f)
                        os.replace(path + ".part", path)
                    except BaseException:  # noqa: BLE001
                        traceback.print_exc()
                        code = 3
                    os._exit(code)
                running[pid] = (case["idx"], time.monotonic(), path)
            if not running:
                break
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                for p, (idx, t0, _) in list(running.items()):
                    if time.monotonic() - t0 > args.case_timeout:
                        os.kill(p, signal.SIGKILL)
                time.sleep(0.005)
                continue
            idx, t0, path = running.pop(pid)
            try:
                with open(path) as f:
                    results[idx] = json.load(f)
            except (OSError, ValueError):
                how = (f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
                       else f"exit status {os.WEXITSTATUS(status)}")
                results[idx] = {"idx": idx, "outcome": "crashed", "why": how,
                                "case": {k: v for k, v in cases[idx].items() if k != "params"},
                                "params": repr(cases[idx]["params"])}
    counts = {k: 0 for k in OUTCOMES}
    for r in results.values():
        counts[r["outcome"]] += 1
    report = {"seed": args.seed, "cases": len(results), "seconds": round(time.monotonic() - start, 1),
              "counts": counts,
              "failures": [r for r in results.values() if r["outcome"] in ("wrong", "crashed", "torch_only_raise")
                           or (r["outcome"] == "kernelgen_only_raise" and not r.get("deliberate"))],
              "kernelgen_only": [r for r in results.values() if r["outcome"] == "kernelgen_only_raise"]}
    print(json.dumps({k: report[k] for k in ("seed", "cases", "seconds", "counts")}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
