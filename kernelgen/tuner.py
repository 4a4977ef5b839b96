"""The tuner: time a call's top candidates on this GPU and keep the fastest that is accurate.

`tune(x, w, ...)` (one call) and `tune_calls([...])` (many, their builds in parallel) take the
selector's ranking of what the families can run (functional.candidates_for: the untuned choice
first, then the other families' first choices, then more configurations of each), build the
first `top` of them in parallel worker processes, run each on the call's own tensors into an
output poisoned with NaN, check it against F.conv2d computed in float64 on the first images by
the accuracy rules (docs/performance.md), time the accurate ones by CUDA events (calls queued back to back,
the candidates taking turns, the median of several rounds) and keep the fastest. The untuned
choice is always a candidate, so a tuned call is never slower than it, by this measurement. The
choice goes into the call's plan record (plans.py), keyed by the GPU model and the toolchain: a
later process making the same call imports that kernel with no build and no timing.

torch's convolution only checks the answers here; it is never a candidate.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from . import config, packs
from .kernels import count

log = logging.getLogger("kernelgen")

CALLS_PER_ROUND = 10
ROUNDS = 5


@dataclass
class TuneResult:
    """What tuning one call found.

    spec: the chosen kernel's spec; untuned: the selector's choice without measurement.
    timings: one (spec summary, microseconds or None, note) per candidate tried, in the
        selector's order (None: not timed, the note says why: a failed build, an inaccurate
        answer). seconds: the wall time the call's tuning took, its share of builds included.
    """

    spec: Any
    untuned: Any
    timings: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def speedup(self) -> float:
        """The untuned choice's time over the chosen one's (1.0 where either was not timed)."""
        times = {s: t for s, t, _ in self.timings}
        a, b = times.get(self.untuned.summary()), times.get(self.spec.summary())
        return a / b if a and b else 1.0


def tune(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, stride=1, padding=0,
         dilation=1, groups=1, *, precision: str | None = None, top: int | None = None,
         jobs: int | None = None, activation: str | None = None, negative_slope: float = 0.01,
         residual: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> TuneResult:
    """Tune one kernelgen.conv2d call (F.conv2d's arguments, on CUDA tensors of the real sizes, and
    conv2d's fused epilogue if any): the fastest accurate of its `top` candidates
    (KERNELGEN_TUNE_TOP, default 4) becomes what kernelgen.conv2d runs for it, in this process and
    in later ones (the plan record)."""
    return tune_calls([dict(input=input, weight=weight, bias=bias, stride=stride, padding=padding,
                            dilation=dilation, groups=groups, precision=precision, activation=activation,
                            negative_slope=negative_slope, residual=residual, scale=scale)], top=top, jobs=jobs)[0]


def tune_calls(calls: Sequence[Mapping[str, Any]], top: int | None = None, jobs: int | None = None) -> list[TuneResult]:
    """Tune many calls: each a mapping of kernelgen.conv2d's arguments (input, weight, bias,
    stride, padding, dilation, groups, precision; activation, negative_slope, residual, scale). Every
    call's candidates are built first, all in parallel (`jobs` workers, default KERNELGEN_JOBS),
    then each call is timed in turn."""
    from . import functional
    from .warm import warm_specs

    top = config.tune_top() if top is None else top
    if top < 1:
        raise ValueError(f"top must be at least 1, got {top}")
    start = time.perf_counter()
    plans = []
    for c in calls:
        args = _args(c)
        specs, call = functional.candidates_for(**_planned(args), every=True)
        plans.append((args, _pick(specs, top), call))
    todo = [s for _, picked, _ in plans for s in picked]
    built = {}
    if any(len(picked) > 1 for _, picked, _ in plans):
        for r in warm_specs(todo, jobs=jobs):
            built[r.spec] = r
            count("tune_builds", r.status == "built")
    share = (time.perf_counter() - start) / max(len(calls), 1)
    results = []
    for args, picked, call in plans:
        t0 = time.perf_counter()
        result = _tune_one(args, picked, call, built)
        result.seconds = share + time.perf_counter() - t0
        results.append(result)
    return results


def _args(c: Mapping[str, Any]) -> dict:
    known = ("input", "weight", "bias", "stride", "padding", "dilation", "groups", "precision", "activation",
             "negative_slope", "residual", "scale")
    unknown = sorted(set(c) - set(known))
    if unknown:
        raise TypeError(f"tune_calls: unknown argument(s) {unknown}; a call takes {list(known)}")
    args = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1, "precision": None,
            "activation": None, "negative_slope": 0.01, "residual": None, "scale": None,
            **{k: c[k] for k in known if k in c}}
    if args["activation"] == "leaky_relu":
        from .checks import slope_bits

        slope_bits(args["negative_slope"])  # (a bad slope is explained before anything builds)
    return args


def _planned(args: dict) -> dict:
    """A call's arguments as functional.candidates_for and spec_for take them (no slope: it is not
    part of the kernel)."""
    return {k: v for k, v in args.items() if k != "negative_slope"}


def _alpha(args: dict) -> int:
    """The slope's bits the kernels take (functional._run's alpha)."""
    from .checks import slope_bits

    return slope_bits(args["negative_slope"]) if args["activation"] == "leaky_relu" else 0


def _pick(specs: list, top: int) -> list:
    """The first `top` of a call's ranked candidates (the untuned choice first): each family's own
    first choice before any family's second configuration, so that the families are compared
    before tiles within one."""
    return specs[:top]


def _tune_one(args: dict, picked: list, call, built: Mapping) -> TuneResult:
    if not picked:  # nothing to compute (an empty batch)
        raise ValueError("tune: this call computes nothing (an empty batch)")
    untuned = picked[0]
    measured = measure(args, picked, call, built) if len(picked) > 1 else []
    times = {spec: us for spec, us, _ in measured if us is not None}
    # The fastest accurate one; the untuned choice wins ties (and stands where none was timed).
    best = min(times, key=lambda s: (times[s], s != untuned)) if times else untuned
    if times and untuned not in times:
        log.warning("kernelgen.tune: the untuned choice %s was not usable here; chose %s", untuned.summary(),
                    best.summary())
    timings = [(spec.summary(), us, note) for spec, us, note in measured]
    _remember(args, best, timings)
    return TuneResult(spec=best, untuned=untuned, timings=timings)


def measure(args: dict, specs: list, call, built: Mapping) -> list[tuple]:
    """(spec, microseconds or None, note) for each of a call's candidate `specs`, built already
    (`built`: spec -> warm.Result): each run once into a poisoned output and checked against
    float64, then the accurate ones timed in turns (_stream_us). `args`: the call's arguments."""
    from . import functional
    from .kernels import load_entry

    x, w, b, res, alpha = args["input"], args["weight"], args["bias"], args["residual"], _alpha(args)
    scale = args["scale"]
    ref, bound = _reference(args)
    notes, runs = {}, []
    for spec in specs:
        r = built.get(spec)
        launch = load_entry(r.key) if r is not None and r.key else None
        if launch is None:
            notes[spec] = f"build failed: {r.message[:300] if r else 'not built'}"
            continue
        plan = functional._plan(launch, r.key, functional._call_fields(call), functional._prep_name(spec), x, w, b,
                                res)
        err = _error(plan, x, w, b, ref, res, alpha, scale)
        if not err <= bound:  # (NaN too)
            notes[spec] = f"inaccurate: relative error {err:.2e} > {bound:.2e}"
            continue
        runs.append((spec, plan))
    times = dict(zip((s for s, _ in runs), _stream_us([lambda p=p: functional._run(p, x, w, b, residual=res,
                                                                                    alpha=alpha, scale=scale)
                                                       for _, p in runs],
                                                      cuda=x.is_cuda)))
    packs.drop(w, [plan.key for _, plan in runs])  # (the candidates' packed weights: the call packs its own)
    count("tune_timings", len(runs))
    return [(spec, times.get(spec), notes.get(spec, "")) for spec in specs]


def _reference(args: dict) -> tuple[torch.Tensor, float]:
    """(F.conv2d in float64 on the first two images, its epilogue too, the relative error a
    candidate may have): the accuracy rules, 1e-5 for exact float32; for TF32 1.5x the larger of
    F.conv2d's own and the exact convolution of TF32-rounded operands; for 16-bit 1.5x F.conv2d's
    own (torch's epilogue after it, in the call's dtype)."""
    import torch.nn.functional as F

    from .compiled import epilogue
    from .precision import fp32_math

    x, w, b = args["input"], args["weight"], args["bias"]
    kw = dict(stride=args["stride"], padding=args["padding"], dilation=args["dilation"], groups=args["groups"])
    xs = x[:2] if x.dim() == 4 else x
    res = args["residual"]
    if res is not None and x.dim() == 4:
        res = res[:2]

    scale = args["scale"]

    def conv(x, w, b):  # torch's convolution and epilogue (float64: the slope as the kernels take it)
        slope = float(torch.tensor(args["negative_slope"], dtype=torch.float32))
        y = F.conv2d(x, w, b if scale is None else None, **kw)  # (with a scale, the bias follows it)
        return epilogue(y, args["activation"], slope, None if res is None else res.to(y.dtype), scale,
                        None if scale is None else b)

    ref = conv(xs.double(), w.double(), None if b is None else b.double())
    if x.dtype == torch.float64:
        return ref, 1e-12
    if x.dtype == torch.float32:
        if fp32_math(args["precision"]) == "ieee":
            return ref, 1e-5
        r = lambda t: None if t is None else _tf32(t).double()  # noqa: E731
        own = _rel(conv(xs, w, b), ref)
        return ref, 1.5 * max(own, _rel(conv(r(xs), r(w), r(b)), ref))
    return ref, 1.5 * _rel(conv(xs, w, b), ref)


def _tf32(t: torch.Tensor) -> torch.Tensor:
    """t rounded to TF32 (10 mantissa bits, nearest, ties away: cvt.rna.tf32.f32)."""
    bits = t.float().contiguous().view(torch.int32)
    rounded = (bits + 0x1000) & ~0x1FFF
    return rounded.view(torch.float32)


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm().clamp_min(1e-300))


def _error(plan, x, w, b, ref, residual=None, alpha=0, scale=None) -> float:
    """The candidate's relative error against `ref`, run into an output full of NaN, so that an
    element it does not write fails."""
    from . import functional

    out = torch.full(plan.out_shape, float("nan"), dtype=x.dtype, device=x.device).contiguous(
        memory_format=plan.fmt)
    y = functional._run(plan, x, w, b, out=out, residual=residual, alpha=alpha, scale=scale)
    if y.dim() == 4:
        y = y[:ref.shape[0]]
    return _rel(y, ref) if bool(torch.isfinite(y).all()) else math.inf


def _stream_us(fns: list, cuda: bool = True) -> list[float]:
    """Each function's median per-call time in microseconds: CALLS_PER_ROUND calls queued back to
    back behind a GPU sleep (so the host never holds the GPU up), the functions taking turns over
    ROUNDS rounds after a warm-up. On the CPU (`cuda` False) the calls are timed by the clock."""
    if not fns:
        return []
    times = [[] for _ in fns]
    for fn in fns:
        fn()
    for _ in range(ROUNDS):
        for t, fn in zip(times, fns):
            if not cuda:
                t0 = time.perf_counter()
                for _ in range(CALLS_PER_ROUND):
                    fn()
                t.append((time.perf_counter() - t0) * 1e6 / CALLS_PER_ROUND)
                continue
            torch.cuda.synchronize()
            torch.cuda._sleep(2_000_000)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(CALLS_PER_ROUND):
                fn()
            end.record()
            end.synchronize()
            t.append(start.elapsed_time(end) * 1e3 / CALLS_PER_ROUND)
    return [statistics.median(t) for t in times]


def _remember(args: dict, spec, timings: list) -> None:
    """Write the choice into the call's plan record and forget the in-process plan, so the next
    kernelgen.conv2d call serves it."""
    from . import functional, plans
    from .kernels import default_cache, load_kernel
    from .toolchain import current

    x = args["input"]
    sig = functional.signature(x, args["weight"], args["bias"], args["stride"], args["padding"], args["dilation"],
                               args["groups"], args["precision"], None, None, args["activation"], args["residual"],
                               args["scale"])
    if sig is None:
        return
    functional._plans.pop(sig, None)
    cache = default_cache()
    if not cache.writable:
        return
    toolchain = current("cuda", functional._gpu(x.device.index).arch) if x.is_cuda else current("cpu")
    _, key = load_kernel(spec, toolchain)
    _, call = functional.spec_for(**_planned(args))
    record = {"key": key, "call": functional._call_fields(call), "prep": functional._prep_name(spec),
              "summary": spec.summary(),
              "tuned": {"spec": spec.to_json(), "us": {s: t for s, t, _ in timings},
                        "notes": {s: n for s, _, n in timings if n},
                        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z")}}
    plans.write(cache.root, functional._record_name(sig, x), record)
