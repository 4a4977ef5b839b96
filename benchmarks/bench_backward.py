"""Backward of convolutions: kernelgen's gradients beside cuDNN's, side by side in one process.

Issue 56, item 4. kernelgen.conv2d's gradients (kernelgen/gradients.py: the input gradient, the
weight gradient, the bias gradient) are computed by kernelgen's own forward kernels through autograd;
F.conv2d's by cuDNN (aten.convolution_backward). For each layer and each cell (precision tf32, ieee,
bf16 x memory format nchw, cl) this script builds x, w (and b where the layer has a bias, or with
`--bias`) with requires_grad, seeded random (never zeros), and a fixed random grad_out `gy` in the
cell's dtype and format, and:

- times the backward alone. Each library's forward runs once, untimed; each timed call is
  `torch.autograd.grad(y, (x, w, b), gy, retain_graph=True)` on that output, so the graph is
  reused and the forward stays out of the timing (what autograd's engine does per call is in it,
  alike for both). Medians of CUDA-event-timed calls, the functions taking turns round by round
  (bench_cases.rounds_ms); on the CPU, host-clock medians. The forward (as training runs it, grad
  enabled) is timed in the same rounds, for the "backward costs N x forward" figure; kernelgen's
  forward reads weights packed once (kernelgen/packs.py), as inference does, where a training
  step's updated weights would be packed again. The gradients' operands (the flipped weight, grad_out
  as the weight gradient's weight) are new tensors each call, packed each call.
- checks each gradient of both libraries against float64: F.conv2d's autograd in float64 on the
  same inputs, the same device, as ||g - g64|| / ||g64||. The gradients checked are the timed calls'
  own (the whole batch), read on a sample where float64 would cost too much: dx on the first images,
  dw on the first output channels (whole groups) over every image, in batch chunks, each within
  REF_FLOPS of float64 work and REF_ELEMENTS elements a tensor; db whole. A gradient's ratio is
  kernelgen's error over torch's; it is flagged past 1.5x the bar (docs/performance.md's accuracy
  rules: torch's own error; in TF32 the larger of that and TF32's own, the exact gradient of the
  TF32-rounded operands, as bench_layers.accuracy_bound does for outputs, since cuDNN runs some
  layers in full float32 with TF32 allowed) and past 1e-5 (below it both are float32 rounding and
  their ratio is noise), or where it is not finite.

    python benchmarks/bench_backward.py [--layers cases,layers,NAME,...] [--cells tf32-nchw,bf16-cl]
        [--bias] [--device cuda|cpu] [--rounds 3] [--reps 15] [--warmup 10] [--budget-s 540]
        [--skip N] [--json out.json] [--list]
    python benchmarks/bench_backward.py --report a.json [b.json ...]   # saved runs' tables; no GPU

`--layers` takes layer names and groups: `cases` (bench_cases.py's five KernelBench cases and the
ResNet stem, as case.87, ..., case.stem), `layers` (bench_layers.py's 28), `census` (census.py's
seeded sample of 320), `networks` (census.network_sample(): networks.py's distinct layers at batch
1 and 32; needs torchvision) and `tiny` (four small layers for the CPU). Default: cases,layers on
a GPU, tiny on the CPU. `--list` prints the layers and needs no GPU.

Before a group of layers is timed, the kernels of its forwards and gradients (other specs than the
forward's: flipped and transposed weights, phases of a strided input gradient, the weight gradient's
batch-as-channels convolution) are found by running the forward and each gradient on meta tensors
under kernelgen.functional.observe_meta_calls, and compiled in parallel (kernelgen.warm.warm_specs,
KERNELGEN_JOBS workers); a row's `compiled_late` counts what its timing still had to compile.
Layers run in the order given, each in every cell; `--budget-s` stops starting layers when the
time left is less than the longest layer took, and the JSON's `not_run` names the layers left;
`--skip N` starts a later call after the first N layers (a census takes several calls: `--report`
merges their JSON). A (layer, cell) that raises is an error row and the others go on; the JSON is
rewritten after each layer, so a cut run keeps what it measured.

The summary per cell: layers kernelgen wins and loses, those at >= 0.95x, the geometric mean of the
backward speedups, and apart the depthwise layers' (census.Layer.kind(); the issue's targets: every
layer >= 0.95x cuDNN, depthwise >= 3x) and the others'.

Without CUDA it runs on the CPU (kernelgen's CPU kernels beside F.conv2d on the CPU): a smoke check
of the whole script, whose timings mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_layers  # noqa: E402
import census  # noqa: E402
import kernelgen  # noqa: E402
from bench_cases import CASES, rel_err, rounds_ms, set_tf32, tf32_round  # noqa: E402
from bench_layers import _geomean  # noqa: E402
from bench_networks import _list, _tf32_settings, _write_json, observed_specs  # noqa: E402
from census import ContextLost, Layer, _check_alive, _commit, _error  # noqa: E402

CELLS = census.CELLS  # tf32-nchw, tf32-cl, ieee-nchw, ...
DEFAULT_CELLS = ("tf32-nchw", "bf16-cl")
GRADS = ("dx", "dw", "db")
# The float64 reference's sample (see the docstring): float64 work per pass, elements per tensor.
REF_FLOPS, REF_ELEMENTS = 20e9, 1 << 27
FLAG_RATIO, STRICT_FP32 = 1.5, 1e-5  # as bench_networks': past 1.5x the bar, and past float32's

# ------------------------------------------------------------------------------------ layers


def _tiny() -> list[Layer]:
    """Small layers for the CPU: a 3x3 with a bias, a strided 3x3 (its input gradient in four
    phases), a depthwise 3x3 with a bias, a 1x1."""
    return [Layer("tiny.3x3", 2, 8, 16, 10, 10, (3, 3), padding=1, bias=True),
            Layer("tiny.3x3.s2", 2, 8, 8, 9, 9, (3, 3), stride=2, padding=1),
            Layer("tiny.dw3x3", 2, 8, 8, 10, 10, (3, 3), groups=8, padding=1, bias=True),
            Layer("tiny.pw", 2, 16, 8, 8, 8, (1, 1))]


def _cases() -> list[Layer]:
    return [Layer(**dict(asdict(c), name=f"case.{key}")) for key, c in CASES.items()]


def _bench_layers() -> list[Layer]:
    return [Layer(**asdict(c)) for c in bench_layers.LAYERS.values()]


GROUPS = {"tiny": _tiny, "cases": _cases, "layers": _bench_layers, "census": lambda: census.layers(0, 320),
          "networks": census.network_sample}
DEFAULT_LAYERS = {"cuda": "cases,layers", "cpu": "tiny"}


def select(text: str) -> list[Layer]:
    """The layers of comma-separated group and layer names, each once, in the order given.
    KeyError for a name no group has (networks' only looked in where torchvision imports)."""
    chosen: dict[str, Layer] = {}
    known: dict[str, Layer] = {}
    for token in filter(None, text.split(",")):
        if token in GROUPS:
            for layer in GROUPS[token]():
                chosen.setdefault(layer.name, layer)
            continue
        for group, make in GROUPS.items():
            if token in known:
                break
            try:
                known.update((layer.name, layer) for layer in make())
            except ImportError:
                if group != "networks":
                    raise
        if token not in known:
            raise KeyError(token)
        chosen.setdefault(token, known[token])
    return list(chosen.values())


# ------------------------------------------------------------------------------------ tensors


def tensors(layer: Layer, precision: str, fmt: str, device: str):
    """(x, w, b, gy): census._tensors' input, weight and bias (None without one), requiring grad,
    and a seeded random grad_out of the output's shape, all in the cell's dtype and format."""
    x, w, b = census._tensors(layer, precision, fmt, device)
    shape = (layer.N, layer.K, *layer.out_size())
    if device == "meta":
        gy = torch.empty(shape, device=device, dtype=x.dtype)
    else:
        g = torch.Generator(device=device).manual_seed(2)
        gy = (torch.rand(shape, device=device, generator=g) - 0.5).to(x.dtype)
    if fmt == "cl":
        gy = gy.contiguous(memory_format=torch.channels_last)
    for t in (x, w, b):
        if t is not None:
            t.requires_grad_()
    return x, w, b, gy


def _forward(layer: Layer, precision: str, x, w, b):
    pr, kw = census._precision(precision), layer.kwargs()
    return (lambda: kernelgen.conv2d(x, w, b, precision=pr, **kw)), (lambda: F.conv2d(x, w, b, **kw))


# ------------------------------------------------------------------------------------ warming


def plan(layer: Layer, cell: str, device: str) -> dict[str, list]:
    """{'forward', 'dx', 'dw': the specs of the kernelgen.conv2d calls each makes}, found on meta
    tensors: the forward, then each gradient alone through autograd (kernelgen's backward runs
    on meta too), planned for `device`. (The bias gradient is a torch.sum: no kernel.)"""
    precision, fmt = cell.split("-")
    set_tf32(precision != "ieee")
    x, w, b, gy = tensors(layer, precision, fmt, "meta")
    found = {"forward": observed_specs(_forward(layer, precision, x, w, b)[0], device)}
    for part, leaf in (("dx", 0), ("dw", 1)):
        # Only this gradient's leaf requires grad: backward computes what the Function's inputs
        # require, whatever autograd.grad asks for.
        t = [None if v is None else v.detach() for v in (x, w, b)]
        t[leaf].requires_grad_()
        y = _forward(layer, precision, *t)[0]()
        found[part] = observed_specs(lambda: torch.autograd.grad(y, (t[leaf],), gy), device)
    return found


def warm(layers: list[Layer], cells, device: str, jobs: int) -> tuple[dict, dict, float]:
    """Compiles, in parallel, every kernel the (layer, cell) pairs will call: ({(name, cell): plan},
    {(name, cell): why it cannot run}, seconds)."""
    from kernelgen.warm import warm_specs

    t0 = time.perf_counter()
    plans, failed, users = {}, {}, {}
    for layer in layers:
        for cell in cells:
            key = (layer.name, cell)
            try:
                plans[key] = plan(layer, cell, device)
            except Exception as exc:  # conv2d would raise the same: the row says so
                failed[key] = _error(exc)
                continue
            for spec in {s for specs in plans[key].values() for s in specs}:
                users.setdefault(spec, []).append(key)
    try:
        results = warm_specs(sorted(users, key=lambda s: s.to_json()), jobs=jobs)
    except Exception as exc:  # noqa: BLE001 (no toolchain, say: each call will say so too)
        print(f"# warm_specs failed: {_error(exc)}", flush=True)
        results = []
    for r in results:
        if r.status == "failed":
            failed.update((key, f"compile failed: {r.spec.summary()}: {r.message}"[:500]) for key in users[r.spec])
    built = sum(r.status == "built" for r in results)
    print(f"# compiled {len(results)} kernels ({built} built) for {len(layers)} layers in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    return plans, failed, time.perf_counter() - t0


# ------------------------------------------------------------------------------------ accuracy


def sample(layer: Layer) -> tuple[int, int]:
    """(n, ko): the images of dx and the output channels of dw checked against float64. All of
    them where the float64 work stays under REF_FLOPS and a tensor under REF_ELEMENTS; else the
    first n images, and the first ko output channels (whole groups where groups > 1)."""
    P, Q = layer.out_size()
    image_flops = layer.flops() / layer.N
    image_elements = layer.C * layer.H * layer.W + layer.K * P * Q
    n = max(1, min(layer.N, int(REF_FLOPS // max(image_flops, 1)), REF_ELEMENTS // image_elements))
    units = layer.groups if layer.groups > 1 else layer.K
    m = max(1, min(units, int(units * REF_FLOPS // max(layer.flops(), 1))))
    return n, m * (layer.K // layer.groups if layer.groups > 1 else 1)


def reference(layer: Layer, x, w, gy, n: int, ko: int, cast) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx of the first n images, dw of the first ko output channels) by F.conv2d's autograd on
    the operands as `cast` makes them (float64, or TF32-rounded then float64); dw accumulated in
    float64 over batch chunks of under REF_ELEMENTS elements a tensor."""
    x, w, gy = x.detach(), w.detach(), gy.detach()
    kw = layer.kwargs()
    xs = cast(x[:n]).requires_grad_()
    dx = torch.autograd.grad(F.conv2d(xs, cast(w), None, **kw), xs, cast(gy[:n]))[0]
    del xs
    G = layer.groups
    m = 1 if G == 1 else ko // (layer.K // G)  # the groups of the first ko output channels
    cx = layer.C if G == 1 else m * (layer.C // G)
    ws = cast(w[:ko]).requires_grad_()
    P, Q = layer.out_size()
    chunk = max(1, REF_ELEMENTS // (cx * layer.H * layer.W + ko * P * Q))
    dw = torch.zeros_like(ws)
    for i in range(0, layer.N, chunk):
        y = F.conv2d(cast(x[i:i + chunk, :cx]), ws, None, **dict(kw, groups=m))
        dw += torch.autograd.grad(y, ws, cast(gy[i:i + chunk, :ko]))[0]
    return dx, dw


def _ratio(err: float, torch_err: float) -> float:
    return err / torch_err if torch_err > 0 else (math.inf if err > 0 else 1.0)


def accuracy(layer: Layer, precision: str, x, w, b, gy, runs: dict) -> dict:
    """{grad: its errors, ratio, bound and flag} for dx, dw (and db with a bias): each library's
    gradients (runs: {'kernelgen', 'torch': a callable returning them}) on the sample (sample())
    against float64's."""
    n, ko = sample(layer)
    refs = dict(zip(("dx", "dw"), reference(layer, x, w, gy, n, ko, lambda t: t.double())))
    if b is not None:
        refs["db"] = gy.detach().sum((0, 2, 3), dtype=torch.float64)
    tf32 = {}
    if precision == "tf32":  # TF32's own error: the exact gradients of the TF32-rounded operands
        rounded = reference(layer, x, w, gy, n, ko, lambda t: tf32_round(t).double())
        tf32 = {g: rel_err(t, refs[g]) for g, t in zip(("dx", "dw"), rounded)}
        del rounded
    errs: dict[str, dict] = {g: {} for g in refs}
    for lib, run in runs.items():
        grads = dict(zip(GRADS, run()))
        for g, t in grads.items():
            part = t[:n] if g == "dx" else t[:ko] if g == "dw" else t
            errs[g][lib] = (rel_err(part, refs[g]), bool(torch.isfinite(t).all()))
        del grads
    out = {}
    for g, e in errs.items():
        (err, finite), (torch_err, torch_finite) = e["kernelgen"], e["torch"]
        bar = max(torch_err, tf32.get(g, 0.0))
        bound = max(FLAG_RATIO * bar, STRICT_FP32)
        out[g] = dict(rel_err=err, torch_rel_err=torch_err, tf32_rel_err=tf32.get(g), ratio=_ratio(err, torch_err),
                      bound=bound, finite=finite, torch_finite=torch_finite, flagged=not finite or err > bound)
    out["sample"] = dict(dx_images=n, dw_channels=ko, of_images=layer.N, of_channels=layer.K)
    return out


# ------------------------------------------------------------------------------------ one row


def measure(layer: Layer, cell: str, device: str, args) -> dict:
    """The backward and forward times of both libraries, and the gradients' accuracy."""
    precision, fmt = cell.split("-")
    set_tf32(precision != "ieee")
    cuda = device == "cuda"
    compiles = kernelgen.stats()["compiles"]
    x, w, b, gy = tensors(layer, precision, fmt, device)
    leaves = tuple(t for t in (x, w, b) if t is not None)
    fk, ft = _forward(layer, precision, x, w, b)
    yk, yt = fk(), ft()
    bk = lambda: torch.autograd.grad(yk, leaves, gy, retain_graph=True)  # noqa: E731
    bt = lambda: torch.autograd.grad(yt, leaves, gy, retain_graph=True)  # noqa: E731
    kg_bwd, t_bwd, kg_fwd, t_fwd = rounds_ms(bk, bt, fk, ft, rounds=args.rounds, reps=args.reps, warmup=args.warmup,
                                             cuda=cuda)
    grads = accuracy(layer, precision, x, w, b, gy, {"kernelgen": bk, "torch": bt})
    return dict(kernelgen_bwd_ms=kg_bwd, torch_bwd_ms=t_bwd, speedup=t_bwd / kg_bwd, kernelgen_fwd_ms=kg_fwd,
                torch_fwd_ms=t_fwd, fwd_speedup=t_fwd / kg_fwd, kernelgen_bwd_per_fwd=kg_bwd / kg_fwd,
                torch_bwd_per_fwd=t_bwd / t_fwd, grads=grads,
                flagged=any(grads[g]["flagged"] for g in GRADS if g in grads),
                compiled_late=kernelgen.stats()["compiles"] - compiles)


def _families(specs: list) -> str:
    """'wgmma' or 'depthwise x4': the families of a part's kernels, with their counts."""
    names = [s.family for s in specs]
    return "+".join(f"{f}{'' if names.count(f) == 1 else f' x{names.count(f)}'}" for f in dict.fromkeys(names))


def _kernels(p: dict) -> dict:
    return {part: [s.summary() for s in specs] for part, specs in p.items()} | {
        "families": {part: _families(specs) for part, specs in p.items()}}


def _release(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------ output


def _fmt_row(r: dict) -> str:
    head = f"| {r['layer']} | {r['kind']} | {r['cell']} |"
    if "error" in r:
        return f"{head} | | | | | | | ERROR {r['error'][:160]} |"
    g = r["grads"]
    ratios = " / ".join(f"{g[k]['ratio']:.2f}" if k in g else "-" for k in GRADS)
    flags = [k for k in GRADS if k in g and g[k]["flagged"]]
    fam = r.get("kernels", {}).get("families", {})
    return (f"{head} {r['kernelgen_bwd_ms']:.3f} | {r['torch_bwd_ms']:.3f} | {r['speedup']:.2f}x | "
            f"{r['kernelgen_fwd_ms']:.3f} / {r['torch_fwd_ms']:.3f} | "
            f"{r['kernelgen_bwd_per_fwd']:.1f} / {r['torch_bwd_per_fwd']:.1f} | {ratios} | "
            f"{'FLAG ' + ','.join(flags) if flags else ''} | dx {fam.get('dx', '?')}; dw {fam.get('dw', '?')} |")


def table(rows: list[dict]) -> list[str]:
    return (["| layer | kind | cell | kernelgen bwd ms | torch bwd ms | speedup | fwd ms kernelgen / torch | "
             "bwd/fwd kernelgen / torch | error x torch's dx / dw / db | flag | kernelgen's backward |",
             "|---|---|---|---|---|---|---|---|---|---|---|"] + [_fmt_row(r) for r in rows])


def summarize(rows: list[dict]) -> list[dict]:
    """Per cell: layers, errors, flagged, wins, losses, at >= 0.95x, geomean speedup (all,
    depthwise, others), depthwise at >= 3x, the slowest layer, geomean backward/forward."""
    out = []
    for cell in dict.fromkeys(r["cell"] for r in rows):
        rs = [r for r in rows if r["cell"] == cell]
        ok = [r for r in rs if "speedup" in r]
        dw = [r for r in ok if r["kind"] == "depthwise"]
        rest = [r for r in ok if r["kind"] != "depthwise"]
        gm = lambda group: _geomean(r["speedup"] for r in group) if group else None  # noqa: E731
        worst = min(ok, key=lambda r: r["speedup"]) if ok else None
        out.append(dict(cell=cell, layers=len(rs), errors=len(rs) - len(ok), flagged=sum(r["flagged"] for r in ok),
                        faster=sum(r["speedup"] >= 1 for r in ok), slower=sum(r["speedup"] < 1 for r in ok),
                        at_least_0_95=sum(r["speedup"] >= 0.95 for r in ok), geomean=gm(ok), depthwise=len(dw),
                        depthwise_geomean=gm(dw), depthwise_at_least_3=sum(r["speedup"] >= 3 for r in dw),
                        others=len(rest), others_geomean=gm(rest),
                        worst=None if worst is None else [worst["layer"], worst["speedup"]],
                        kernelgen_bwd_per_fwd=_geomean(r["kernelgen_bwd_per_fwd"] for r in ok) if ok else None,
                        torch_bwd_per_fwd=_geomean(r["torch_bwd_per_fwd"] for r in ok) if ok else None))
    return out


def _x(v, spec: str = ".2f") -> str:
    return "-" if v is None else f"{v:{spec}}x"


def summary_table(summary: list[dict]) -> list[str]:
    lines = ["| cell | layers | errors | flagged | faster | slower | >= 0.95x | geomean | depthwise geomean (>= 3x) | "
             "others' geomean | slowest | bwd/fwd kernelgen / torch |", "|---" * 12 + "|"]
    for s in summary:
        worst = "-" if s["worst"] is None else f"{s['worst'][0]} {s['worst'][1]:.2f}x"
        lines.append(f"| {s['cell']} | {s['layers']} | {s['errors']} | {s['flagged']} | {s['faster']} | "
                     f"{s['slower']} | {s['at_least_0_95']} | {_x(s['geomean'])} | "
                     f"{_x(s['depthwise_geomean'])} of {s['depthwise']} ({s['depthwise_at_least_3']}) | "
                     f"{_x(s['others_geomean'])} of {s['others']} | {worst} | "
                     f"{_x(s['kernelgen_bwd_per_fwd'], '.1f')} / {_x(s['torch_bwd_per_fwd'], '.1f')} |")
    return lines


def show(rows: list[dict]) -> None:
    print()
    print("\n".join(table(rows)))
    print()
    print("\n".join(summary_table(summarize(rows))))


def _progress(r: dict) -> str:
    head = f"{r['layer']:34} {r['cell']:9}"
    if "error" in r:
        return f"{head} ERROR {r['error'][:200]}"
    g = r["grads"]
    return (f"{head} bwd {r['kernelgen_bwd_ms']:8.3f} / {r['torch_bwd_ms']:8.3f} ms {r['speedup']:5.2f}x  "
            f"fwd {r['fwd_speedup']:5.2f}x  error x torch's "
            + " ".join(f"{k} {g[k]['ratio']:.2f}" for k in GRADS if k in g) + ("  FLAG" if r["flagged"] else ""))


# ------------------------------------------------------------------------------------ the run


def header(args, layers: list[Layer]) -> dict:
    cuda = args.device == "cuda"
    device = torch.cuda.get_device_name() if cuda else f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
    return dict(device=device, device_kind=args.device, torch=torch.__version__, cuda=torch.version.cuda,
                cudnn=torch.backends.cudnn.version() if cuda else None, cudnn_benchmark=torch.backends.cudnn.benchmark,
                kernelgen=kernelgen.__version__, kernelgen_commit=_commit(), tf32=_tf32_settings(),
                cells=args.cells, layers=[layer.name for layer in layers], skip=args.skip, bias=args.bias,
                timing=dict(rounds=args.rounds, reps=args.reps, warmup=args.warmup),
                reference=dict(flops=REF_FLOPS, elements=REF_ELEMENTS), budget_s=args.budget_s, rows=[], warm=[],
                not_run=[], summary=[])


def run(layers: list[Layer], args) -> dict:
    result = header(args, layers)
    cuda = args.device == "cuda"
    print(f"# {result['device']}; torch {result['torch']}; cuDNN {result['cudnn']}; kernelgen "
          f"{result['kernelgen_commit']}; cells {args.cells}; {len(layers)} layers", flush=True)
    if not cuda:
        print("# CPU path: a smoke check of the script; kernelgen's CPU kernels exist for correctness and these "
              "timings mean nothing", flush=True)
    jobs = int(os.environ.get("KERNELGEN_JOBS", "0")) or os.cpu_count() or 1
    end = time.monotonic() + args.budget_s
    longest, started = 0.0, 0
    try:
        for start in range(0, len(layers), 2 * jobs):  # compiled a part at a time: a spent budget stops compiles
            if end - time.monotonic() <= longest:
                break
            part = layers[start:start + 2 * jobs]
            plans, failed, seconds = warm(part, args.cells, args.device, jobs)
            result["warm"].append(dict(layers=[layer.name for layer in part], seconds=seconds,
                                       failed={f"{k[0]} {k[1]}": v for k, v in failed.items()}))
            for layer in part:
                if end - time.monotonic() <= longest:  # it would likely run past the budget
                    break
                started += 1
                t0 = time.monotonic()
                for cell in args.cells:
                    precision, fmt = cell.split("-")
                    row = dict(layer=layer.name, kind=layer.kind(), cell=cell, precision=precision, format=fmt,
                               shape=asdict(layer))
                    if (layer.name, cell) in plans:
                        row["kernels"] = _kernels(plans[layer.name, cell])
                    if (layer.name, cell) in failed:
                        row["error"] = failed[layer.name, cell]
                    else:
                        t1 = time.monotonic()
                        try:
                            row.update(measure(layer, cell, args.device, args))
                        except ContextLost:
                            raise
                        except Exception as exc:  # one broken layer must not hide the others' numbers
                            row["error"] = _error(exc)
                            if cuda:
                                _check_alive()
                        row["seconds"] = time.monotonic() - t1
                    _release(cuda)
                    result["rows"].append(row)
                    print(_progress(row), flush=True)
                longest = max(longest, time.monotonic() - t0)
                result["summary"] = summarize(result["rows"])
                if args.json:
                    _write_json(args.json, result)
    except ContextLost as exc:
        print(f"# the CUDA context is lost, so nothing more can run: {exc}", flush=True)
        result["context_lost"] = str(exc)
    set_tf32(True)
    result["not_run"] = [layer.name for layer in layers[started:]]
    if result["not_run"]:
        print(f"# not run for the time budget: {len(result['not_run'])} layers", flush=True)
    result["summary"] = summarize(result["rows"])
    if args.json:
        _write_json(args.json, result)
    return result


def report_files(paths: list[str]) -> int:
    """The table and summary of saved runs (rows of later files replace the same (layer, cell) rows
    of earlier ones); no device needed."""
    merged: dict[tuple, dict] = {}
    for p in paths:
        saved = json.loads(Path(p).read_text())
        cut = f"; {len(saved['not_run'])} layers not run" if saved["not_run"] else ""
        print(f"# {p}: {saved['device']}; torch {saved['torch']}; cuDNN {saved['cudnn']}; kernelgen "
              f"{saved['kernelgen_commit']}{cut}")
        for r in saved["rows"]:
            merged[(r["layer"], r["cell"])] = r
    show(list(merged.values()))
    return 0


def print_plans(layers: list[Layer], cells, part: str, arch: str) -> int:
    """`--plans`: each (layer, cell)'s kernelgen.conv2d specs for `part` (plan(), on meta tensors)
    for a nominal GPU of `arch`, and a count by family."""
    from collections import Counter

    from kernelgen.functional import planning_for

    counts = Counter()
    with planning_for(arch):
        for layer in layers:
            for cell in cells:
                try:
                    specs = plan(layer, cell, "cuda")[part]
                except Exception as exc:  # noqa: BLE001 (the row says why)
                    print(f"{layer.name:28s} {cell:10s} error: {exc}")
                    continue
                for s in specs:
                    counts[s.family] += 1
                    print(f"{layer.name:28s} {cell:10s} {s.summary()}")
    print("# " + ", ".join(f"{f} {n}" for f, n in counts.most_common()))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", help=f"comma-separated layer names and groups ({', '.join(GROUPS)}); default "
                                     f"{DEFAULT_LAYERS['cuda']} on a GPU, {DEFAULT_LAYERS['cpu']} on the CPU")
    ap.add_argument("--cells", default=",".join(DEFAULT_CELLS), help=f"precision-format pairs, of {list(CELLS)}")
    ap.add_argument("--bias", action="store_true", help="give every layer a bias (default: the layer's own)")
    ap.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda where available, else cpu")
    ap.add_argument("--rounds", type=int, default=3, help="timing rounds (the four functions take turns)")
    ap.add_argument("--reps", type=int, default=15, help="timed calls of each function a round")
    ap.add_argument("--warmup", type=int, default=10, help="untimed calls of each function first")
    ap.add_argument("--budget-s", type=float, default=540, help="stop starting layers past this wall time")
    ap.add_argument("--skip", type=int, default=0, help="leave out the first N layers (to go on from a cut run)")
    ap.add_argument("--json", help="write everything here (rewritten after each layer)")
    ap.add_argument("--list", action="store_true", help="print the layers and exit; no GPU")
    ap.add_argument("--plans", choices=("forward", "dx", "dw"),
                    help="print what the selector plans for each layer's forward, dx or dw on a nominal GPU "
                         "of --arch, and exit; no GPU, no compile")
    ap.add_argument("--arch", default="sm_90a", help="--plans: the nominal GPU's target")
    ap.add_argument("--report", nargs="+", metavar="JSON", help="print the tables of saved runs and exit; no GPU")
    args = ap.parse_args(argv)
    if args.report:
        return report_files(args.report)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() or args.plans else "cpu"
        if args.device == "cpu" and not args.list:
            print("# no CUDA device: running the CPU path (--device cpu)", flush=True)
    args.cells = _list(args.cells, CELLS, "cell", ap)
    try:
        layers = select(args.layers or DEFAULT_LAYERS[args.device])
    except KeyError as exc:
        ap.error(f"unknown layer {exc}; --list shows them")
    except ImportError as exc:
        ap.error(str(exc))
    layers = layers[args.skip:]
    if args.bias:
        layers = [replace(layer, bias=True) for layer in layers]
    if args.plans:
        return print_plans(layers, args.cells, args.plans, args.arch)
    if args.list:
        for layer in layers:
            print(f"{census.describe(layer)}  {layer.kind()}")
        print(census.histogram(layers))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is visible (--device cpu runs the CPU smoke check)")
    result = run(layers, args)
    show(result["rows"])
    bad = [r for r in result["rows"] if "error" in r or r.get("flagged")]
    return 1 if bad or "context_lost" in result else 0


if __name__ == "__main__":
    sys.exit(main())
