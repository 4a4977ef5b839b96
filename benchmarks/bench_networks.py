"""Whole networks: eager cuDNN beside kernelgen.convert and torch.compile, side by side in one process.

Issue 53's network benchmark. For each torchvision network of networks.py (random weights, seeded;
BatchNorm statistics drawn too, so that folding them changes the weights), each cell (float32 NCHW
with torch's default TF32 setting; bfloat16 channels_last) and each batch (1, captured in a CUDA
graph and replayed; 32, eager), it times these variants of the same model on the same input:

    eager              the model as torch runs it (cuDNN)
    kernelgen          kernelgen.convert(copy, example_inputs=(x,))
    kernelgen-bn       ... with fold_bn=True
    kernelgen-bn-fuse  ... with fold_bn=True, fuse=True (where kernelgen.convert takes `fuse`)
    kernelgen-frozen   the best kernelgen variant, its batch-1 graph captured under
                       kernelgen.frozen_weights() (replays read the weights packed once; batch 1 only)
    compile            torch.compile(model) (default mode, dynamic=False)
    compile-kernelgen  torch.compile of the last kernelgen variant's model

    python benchmarks/bench_networks.py [--networks resnet50,...] [--cells fp32-nchw,bf16-cl]
        [--batches 1,32] [--variants eager,kernelgen-bn,...] [--no-compile] [--budget-s 540]
        [--json out.json] [--plot out.svg]
    python benchmarks/bench_networks.py --train [--networks ...] [--cells ...] [--batches 64] [--json out.json]
    python benchmarks/bench_networks.py --report a.json b.json [--plot out.svg]   # saved runs; no GPU

Times are medians of CUDA-event-timed forwards after warm-up, the variants taking turns round by
round (bench_cases.rounds_ms); speedups are eager's time over the variant's. Accuracy: each
variant's logits against a float64 run of the same model (its weights and input upcast), as
‖y − y64‖ / ‖y64‖ beside eager's own error, flagged past 1.5x eager's and past 1e-5 (the strict
float32 bar of docs/performance.md's accuracy rules, under which both are float32 rounding); and top-1 agreement
with eager's logits and with float64's. Before a (network, cell, batch) is timed, the kernels its
conversions will call are found on the meta device and compiled in parallel
(kernelgen.warm.warm_specs, KERNELGEN_JOBS workers). A variant that raises is an error row; the
others go on. `--budget-s` stops starting networks when the time left is less than the longest
one took, and the JSON is rewritten after each network, so a cut run keeps what it measured.

`--train` times a training step instead (issue 56): forward, cross-entropy loss, backward and an
SGD step with momentum, in train mode, at batch 64 by default, eager beside kernelgen.convert (no
folding: BatchNorm trains) and the torch.compile variants. The cells are float32 NCHW (torch's
TF32 default) and bf16 channels_last as mixed-precision training runs it: float32 weights, the
step under torch.autocast(bfloat16). Accuracy is the first step's gradients, every parameter's
together, against a float64 step from the same weights and input, beside eager's own error; the
kernels of the forward and of the gradients are found by a meta run of both and compiled first.

Without a GPU it runs on the CPU, by default on `tiny` (a small hand-built network, no
torchvision): a smoke check of the whole script. Its timings are the CPU path's and mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import inspect
import json
import math
import os
import platform
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kernelgen  # noqa: E402
from bench_cases import rel_err, rounds_ms  # noqa: E402
from bench_layers import _geomean  # noqa: E402
from census import ContextLost, _check_alive, _commit, _error  # noqa: E402
from networks import NETWORKS, _torchvision  # noqa: E402

TINY = "tiny"
CELLS = {"fp32-nchw": (torch.float32, torch.contiguous_format), "bf16-cl": (torch.bfloat16, torch.channels_last)}
BATCHES = (1, 32)
TRAIN_BATCHES = (64,)
# A variant's error past FLAG_RATIO times eager's is flagged (docs/performance.md's accuracy rules), unless it is within
# the accuracy rules' bar for strict float32: there both are float32 rounding, whose ratio is noise.
FLAG_RATIO, STRICT_FP32 = 1.5, 1e-5


@dataclass(frozen=True)
class Variant:
    """One way to run a network. convert: kernelgen.convert's keyword arguments as (name, value)
    pairs, or None for torch's own convolutions; compiled: torch.compile of that model. Variants
    with the same `convert` share one converted model."""

    name: str
    convert: tuple[tuple[str, Any], ...] | None = None
    compiled: bool = False
    frozen: bool = False  # its graph captured under kernelgen.frozen_weights()


def fuse_available() -> bool:
    """Whether this kernelgen.convert takes `fuse` (epilogue fusion), read from its signature."""
    return "fuse" in inspect.signature(kernelgen.convert).parameters


def all_variants(fuse: bool, train: bool = False) -> list[Variant]:
    if train:  # (BatchNorm trains: nothing to fold, and so no epilogue to fuse it into)
        plain = (("fold_bn", False),)
        return [Variant("eager"), Variant("kernelgen", plain), Variant("compile", None, True),
                Variant("compile-kernelgen", plain, True)]
    best = (("fold_bn", True), ("fuse", True)) if fuse else (("fold_bn", True),)
    out = [Variant("eager"), Variant("kernelgen", (("fold_bn", False),)), Variant("kernelgen-bn", (("fold_bn", True),))]
    if fuse:
        out.append(Variant("kernelgen-bn-fuse", best))
    if hasattr(kernelgen, "frozen_weights"):
        out.append(Variant("kernelgen-frozen", best, frozen=True))
    return out + [Variant("compile", None, True), Variant("compile-kernelgen", best, True)]


# ------------------------------------------------------------------------------------ networks


class _SE(nn.Module):
    """Squeeze-excitation: two 1x1 convolutions (with bias) on the pooled 1x1 plane."""

    def __init__(self, channels: int, mid: int):
        super().__init__()
        self.reduce = nn.Conv2d(channels, mid, 1)
        self.expand = nn.Conv2d(mid, channels, 1)

    def forward(self, x):
        s = x.mean((2, 3), keepdim=True)
        return x * torch.sigmoid(self.expand(torch.relu(self.reduce(s))))


def _cbr(cin: int, cout: int, k: int = 3, stride: int = 1, groups: int = 1, relu: bool = True) -> nn.Sequential:
    # With a bias (torchvision's have none), so that folding BatchNorm leaves each layer's kernel as
    # it was: the smoke check compiles five kernels, not eight.
    layers = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups), nn.BatchNorm2d(cout)]
    return nn.Sequential(*layers, nn.ReLU()) if relu else nn.Sequential(*layers)


class TinyNet(nn.Module):
    """The CPU smoke check's network, without torchvision: conv-bn-relu blocks, a residual, a
    depthwise layer, a squeeze-excitation block of 1x1s, and a linear head. Few distinct layer
    shapes, so that its kernels compile in seconds on the CPU."""

    def __init__(self, classes: int = 10, width: int = 16):
        super().__init__()
        self.stem = _cbr(3, width, stride=2)
        self.body = nn.Sequential(_cbr(width, width), _cbr(width, width, relu=False))
        self.dw = _cbr(width, width, groups=width)
        self.se = _SE(width, width // 4)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        x = self.stem(x)
        x = torch.relu(x + self.body(x))
        x = self.se(self.dw(x))
        return self.head(x.mean((2, 3)))


@torch.no_grad()
def _draw_batchnorm(model: nn.Module, seed: int) -> None:
    # Freshly built BatchNorms are the identity (mean 0, var 1, weight 1, bias 0), which would make
    # folding them a no-op; mild draws keep activations in range through a deep network.
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d) and m.running_mean is not None:
            n = m.num_features
            m.running_mean.copy_(0.1 * torch.randn(n, generator=g))
            m.running_var.copy_(0.8 + 0.4 * torch.rand(n, generator=g))
            if m.weight is not None:
                m.weight.copy_(0.8 + 0.4 * torch.rand(n, generator=g))
                m.bias.copy_(0.1 * torch.randn(n, generator=g))


def build(name: str, seed: int) -> nn.Module:
    """Network `name` (torchvision's, or TINY) in eval mode on the CPU, in float32, with seeded
    random weights."""
    torch.manual_seed(seed)
    model = TinyNet() if name == TINY else _torchvision().models.get_model(name, weights=None)
    _draw_batchnorm(model, seed)
    return model.eval()


def in_cell(model: nn.Module, cell: str, device: str) -> nn.Module:
    dtype, fmt = CELLS[cell]
    return model.to(device=device, dtype=dtype, memory_format=fmt)


def make_input(batch: int, image: int, cell: str, device: str, seed: int) -> torch.Tensor:
    dtype, fmt = CELLS[cell]
    x = torch.randn(batch, 3, image, image, generator=torch.Generator().manual_seed(seed + batch))
    return x.to(device=device, dtype=dtype).contiguous(memory_format=fmt)


# ------------------------------------------------------------------------------------ warming


def observed_specs(fn: Callable[[], Any], device: str) -> list:
    """The specs of the kernelgen.conv2d calls `fn` makes on meta tensors, in call order, each
    planned for `device` with the call's own precision, family, tiles and epilogue."""
    from kernelgen.functional import observe_meta_calls, spec_for

    found = []

    def on_call(inp, w, b, stride, padding, dilation, groups, precision, family, tiles, **epilogue):
        # (epilogue: whatever the call fused, activation, residual and scale, as the observer hands it)
        spec, _ = spec_for(inp, w, b, stride, padding, dilation, groups, device=device,
                           precision=precision, family=family, tiles=tiles, **epilogue)
        if spec is not None:
            found.append(spec)

    with observe_meta_calls(on_call):
        fn()
    return found


def meta_specs(model: nn.Module, x: torch.Tensor, backward: bool = False) -> set:
    """The specs of the kernelgen.conv2d calls a meta-device `model` makes on an input like `x`,
    planned for x's device (what `kernelgen warm --model` does, with x's strides and dtype);
    with `backward`, those its gradients make too (a backward pass of the meta output's sum)."""
    meta = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")

    def run() -> None:
        y = model(meta)
        if backward:
            y.float().sum().backward()

    with torch.set_grad_enabled(backward):
        return set(observed_specs(run, x.device.type))


def warm_kernels(base: nn.Module, x: torch.Tensor, converts, backward: bool = False) -> dict:
    """Compile, in parallel, the kernels of each conversion in `converts` (convert's keyword
    pairs) of `base` on `x`: each conversion is made on a meta copy (in x's dtype, which is the
    convolutions' under autocast too), run there to find its calls (with `backward`, its
    gradients' as well). A conversion that fails here is left to the variant's own build, which
    will say why."""
    from kernelgen.warm import warm_specs

    t0 = time.perf_counter()
    specs, unfound = set(), []
    for kw in converts:
        try:
            meta = kernelgen.convert(copy.deepcopy(base).to(device="meta", dtype=x.dtype), **dict(kw))
            specs |= meta_specs(meta, x, backward)
        except Exception as exc:  # noqa: BLE001 (found again, and reported, when the variant is built)
            unfound.append(f"{dict(kw)}: {_error(exc)}")
    try:
        results = warm_specs(sorted(specs, key=lambda s: s.to_json()))
    except Exception as exc:  # noqa: BLE001 (no toolchain, say: each variant's first call will say so too)
        results, unfound = [], unfound + [f"warm_specs: {_error(exc)}"]
    status = Counter(r.status for r in results)
    return dict(kernels=len(results), built=status["built"], cached=status["cached"], seconds=time.perf_counter() - t0,
                failed=[f"{r.spec.summary()}: {r.message[:200]}" for r in results if r.status == "failed"],
                not_found=unfound)


# ------------------------------------------------------------------------------------ variants


def graphed(fn: Callable[[], torch.Tensor], frozen: bool = False) -> Callable[[], torch.Tensor]:
    """`fn` captured in a CUDA graph, after warm-up on a side stream as torch.cuda.graph asks: a
    callable that replays the graph and returns its (static) output. frozen: captured under
    kernelgen.frozen_weights(), after one more call once the warm-up is done (so that kernelgen
    knows its packings finished and the graph may read them)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
        if frozen:
            torch.cuda.synchronize()
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with kernelgen.frozen_weights() if frozen else contextlib.nullcontext(), torch.cuda.graph(graph):
        out = fn()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay


class _Models:
    """The group's models by `Variant.convert`: the cell's model, and each conversion of a deep
    copy of it, made once (a failed conversion is remembered and raised again for its users)."""

    def __init__(self, base: nn.Module, x: torch.Tensor):
        self.base, self.x, self.made = base, x, {}

    def get(self, convert) -> nn.Module:
        if convert not in self.made:
            try:
                self.made[convert] = kernelgen.convert(copy.deepcopy(self.base), example_inputs=(self.x,),
                                                       **dict(convert))
            except Exception as exc:
                self.made[convert] = f"kernelgen.convert({dict(convert)}) failed: {_error(exc)}"
        made = self.made[convert]
        if isinstance(made, str):
            raise RuntimeError(made)
        return made


def prepare(v: Variant, models: _Models, graphs: bool) -> tuple[Callable[[], torch.Tensor], nn.Module]:
    """(a callable running variant `v` once and returning its logits, the model it runs), warmed
    up: its kernels compiled, torch.compile's graph compiled, and captured where `graphs`."""
    model = models.base if v.convert is None else models.get(v.convert)
    run = model
    if v.compiled:  # static shapes: each (network, cell, batch) gets a graph of its own, as eager has
        run = torch.compile(model, dynamic=False)
    x = models.x

    def fn() -> torch.Tensor:
        return run(x)

    fn()  # compiles whatever is not compiled yet, outside the timing
    return (graphed(fn, v.frozen) if graphs else fn), model


def report_counts(model: nn.Module) -> dict:
    """kernelgen.report's summary: layers converted, on kernelgen or fallen back to torch, with
    BatchNorm folded, layers left on torch by convert, and the kernel families used."""
    rows = kernelgen.report(model).rows
    on_kg = [r for r in rows if r["fallback"] is None]
    families = Counter(r["kernel"].split("[")[0].split(" ")[0] for r in on_kg if r["kernel"])
    untouched = sum(isinstance(m, nn.Conv2d) and not isinstance(m, kernelgen.Conv2d)
                    and "kernelgen_layer" not in m.__dict__ for m in model.modules())
    return dict(layers=len(rows), on_kernelgen=len(on_kg), fallbacks=len(rows) - len(on_kg),
                bn_folded=sum(r["bn"] is not None for r in rows), left_on_torch=untouched,
                families=dict(sorted(families.items())))


def _time(fns: dict[str, Callable], cuda: bool, args) -> dict[str, float | str]:
    """{variant: median ms, or the error that stopped it}: all together in alternating rounds;
    where that raises, each alone, so that one failing variant keeps the others' numbers."""
    kw = dict(rounds=args.rounds, reps=args.reps, warmup=args.warmup, cuda=cuda)
    try:
        return dict(zip(fns, rounds_ms(*fns.values(), **kw)))
    except Exception:  # noqa: BLE001 (found again below, variant by variant)
        if cuda:
            _check_alive()
    out: dict[str, float | str] = {}
    for name, fn in fns.items():
        try:
            out[name] = rounds_ms(fn, **kw)[0]
        except Exception as exc:
            out[name] = _error(exc)
            if cuda:
                _check_alive()
    return out


def accuracy(y: torch.Tensor, eager: torch.Tensor | None, ref: torch.Tensor) -> dict:
    """y's relative error against float64's logits `ref`, and its top-1 agreement with eager's
    (None without them) and with float64's: the share of images whose argmax is the same."""
    top = y.float().argmax(-1)
    agree = lambda other: (top == other.float().argmax(-1)).float().mean().item()  # noqa: E731
    return dict(rel_err=rel_err(y, ref), finite=bool(torch.isfinite(y).all()),
                top1_eager=None if eager is None else agree(eager), top1_fp64=agree(ref))


def _flag(row: dict, eager_err: float | None) -> None:
    if eager_err is None or "rel_err" not in row:
        return
    err = row["rel_err"]
    row["eager_rel_err"] = eager_err
    row["err_ratio"] = err / eager_err if eager_err > 0 else (math.inf if err > 0 else 1.0)
    row["err_bound"] = max(FLAG_RATIO * eager_err, STRICT_FP32)
    row["flagged"] = row["variant"] != "eager" and (not row["finite"] or err > row["err_bound"])


def _ready(row: dict, make: Callable[[], Any], cuda: bool) -> Any:
    """What `make` (a variant's preparation) returns, or None where it raised: the row records the
    error or the seconds it took, and a line says which. One failing variant (torch.compile, a
    kernel) must not hide the others."""
    t0 = time.perf_counter()
    made = None
    try:
        made = make()
    except Exception as exc:
        row["error"] = _error(exc)
        if cuda:
            _check_alive()
    row["ready_s"] = time.perf_counter() - t0
    print(f"# {row['network']} {row['cell']} b{row['batch']} {row['variant']}: " +
          (f"ERROR {row['error'][:200]}" if "error" in row else f"ready in {row['ready_s']:.1f} s"), flush=True)
    return made


@torch.no_grad()
def run_group(name: str, cell: str, batch: int, variants: list[Variant], args, until: float) -> tuple[list, dict]:
    """The rows of every variant of network `name` in `cell` at `batch`, and what warming did."""
    cuda = args.device == "cuda"
    graphs = cuda and batch == 1
    base = in_cell(build(name, args.seed), cell, args.device)
    x = make_input(batch, args.image, cell, args.device, args.seed)
    models = _Models(base, x)
    warm = warm_kernels(base, x, dict.fromkeys(v.convert for v in variants if v.convert is not None))
    print(f"# {name} {cell} b{batch}: {warm['kernels']} kernels ({warm['built']} built) in {warm['seconds']:.0f} s"
          + (f"; FAILED {warm['failed']}" if warm["failed"] else ""), flush=True)
    rows, fns, used = {}, {}, {}
    compiles = kernelgen.stats()["compiles"]
    for v in variants:
        if v.frozen and not graphs:
            continue  # (frozen weights change only what a graph replays)
        row = rows[v.name] = dict(network=name, cell=cell, batch=batch, variant=v.name, graph=graphs,
                                  compiled=v.compiled, convert=None if v.convert is None else dict(v.convert))
        if time.monotonic() >= until:
            row["skipped"] = "the time budget was spent"
            continue
        made = _ready(row, lambda: prepare(v, models, graphs), cuda)
        if made is not None:
            fns[v.name], used[v.name] = made
    # Kernels the meta run did not find (none, where warming works) compiled one at a time above.
    warm["compiled_later"] = kernelgen.stats()["compiles"] - compiles
    if warm["compiled_later"]:
        print(f"# {name} {cell} b{batch}: {warm['compiled_later']} kernels compiled after warming", flush=True)
    for v_name, ms in _time(fns, cuda, args).items():
        rows[v_name]["error" if isinstance(ms, str) else "ms"] = ms
    ref = copy.deepcopy(base).to(dtype=torch.float64, memory_format=torch.contiguous_format)(x.double())
    outs = {n: fns[n]().clone() for n in fns if "ms" in rows[n]}
    eager_ms = rows["eager"].get("ms")
    for n, y in outs.items():
        rows[n].update(accuracy(y, outs.get("eager"), ref))
        if eager_ms is not None:
            rows[n]["speedup"] = eager_ms / rows[n]["ms"]
    for n, model in used.items():
        if n in outs and models.base is not model:
            rows[n]["report"] = report_counts(model)
    eager_err = rows["eager"].get("rel_err")
    for row in rows.values():
        _flag(row, eager_err)
    return list(rows.values()), warm


def _mixed(cell: str | None, device: str):
    """The context a training step of `cell` runs in: autocast to bfloat16 for bf16 channels_last
    (float32 weights, as mixed-precision training keeps them), nothing for float32 (or None)."""
    if cell is not None and CELLS[cell][0] is torch.bfloat16:
        return torch.autocast(device, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _gradients(model: nn.Module, x: torch.Tensor, target: torch.Tensor, cell: str | None) -> torch.Tensor:
    """Every parameter's gradient of one cross-entropy step from `model`'s weights, as one float64
    vector (the gradients are left cleared)."""
    model.zero_grad(set_to_none=True)
    with _mixed(cell, x.device.type):
        loss = nn.functional.cross_entropy(model(x), target)
    loss.backward()
    out = torch.cat([p.grad.double().flatten() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return out


def training_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor, cell: str) -> Callable[[], torch.Tensor]:
    """A callable running one training step of `model` (forward, loss, backward, SGD with
    momentum) and returning the loss."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with _mixed(cell, x.device.type):
            loss = nn.functional.cross_entropy(model(x), target)
        loss.backward()
        opt.step()
        return loss

    return step


def run_train_group(name: str, cell: str, batch: int, variants: list[Variant], args, until: float) -> tuple[list, dict]:
    """The rows of every variant's training step of network `name` in `cell` at `batch` (module
    docstring), and what warming did."""
    cuda = args.device == "cuda"
    base = build(name, args.seed).to(device=args.device, memory_format=CELLS[cell][1]).train()
    x = make_input(batch, args.image, cell, args.device, args.seed).float()
    with torch.no_grad():
        classes = base(x[:1]).shape[-1]
    target = torch.randint(classes, (batch,), generator=torch.Generator().manual_seed(args.seed)).to(args.device)
    kernel_x = x.to(CELLS[cell][0])  # (what the convolutions see: autocast's dtype)
    warm = warm_kernels(base, kernel_x, dict.fromkeys(v.convert for v in variants if v.convert is not None),
                        backward=True)
    print(f"# {name} {cell} b{batch} train: {warm['kernels']} kernels ({warm['built']} built) in "
          f"{warm['seconds']:.0f} s" + (f"; FAILED {warm['failed']}" if warm["failed"] else ""), flush=True)
    reference = _gradients(copy.deepcopy(base).double(), x.double(), target, None)
    models = _Models(base, x)
    rows, fns, used = {}, {}, {}
    compiles = kernelgen.stats()["compiles"]
    for v in variants:
        row = rows[v.name] = dict(network=name, cell=cell, batch=batch, variant=v.name, graph=False, train=True,
                                  compiled=v.compiled, convert=None if v.convert is None else dict(v.convert),
                                  top1_eager=None, top1_fp64=None)
        if time.monotonic() >= until:
            row["skipped"] = "the time budget was spent"
            continue
        def make(v: Variant = v, row: dict = row) -> tuple[Callable[[], torch.Tensor], nn.Module]:
            # each variant trains a copy of its own, from the same weights
            model = copy.deepcopy(base if v.convert is None else models.get(v.convert))
            run = torch.compile(model, dynamic=False) if v.compiled else model
            g = _gradients(run, x, target, cell)  # (also compiles what is not compiled yet)
            row.update(rel_err=rel_err(g, reference), finite=bool(torch.isfinite(g).all()))
            step = training_step(run, x, target, cell)
            step()
            return step, model

        made = _ready(row, make, cuda)
        if made is not None:
            fns[v.name], used[v.name] = made
    warm["compiled_later"] = kernelgen.stats()["compiles"] - compiles
    for v_name, ms in _time(fns, cuda, args).items():
        rows[v_name]["error" if isinstance(ms, str) else "ms"] = ms
    eager_ms = rows["eager"].get("ms")
    for n, row in rows.items():
        if "ms" in row and eager_ms is not None:
            row["speedup"] = eager_ms / row["ms"]
        if n in used and "ms" in row and row["convert"] is not None:
            row["report"] = report_counts(used[n])
    eager_err = rows["eager"].get("rel_err")
    for row in rows.values():
        _flag(row, eager_err)
    return list(rows.values()), warm


def _release() -> None:
    gc.collect()
    torch._dynamo.reset()  # a group's compiled graphs are not needed again, and count toward recompile limits
    if torch.cuda.is_available():
        with contextlib.suppress(RuntimeError):  # a lost context is reported by the caller, not here
            torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------ output


def _num(v, spec: str, suffix: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{suffix}"


def _fmt_row(r: dict) -> str:
    head = (f"| {r['network']} | {r['cell']} | {r['batch']}{' graph' if r.get('graph') else ''}"
            f"{' train' if r.get('train') else ''} | {r['variant']} |")
    if "error" in r or "skipped" in r:
        return f"{head} | | | | | | {'ERROR ' + r['error'][:160] if 'error' in r else r['skipped']} |"
    note = "FLAG: error past 1.5x eager's (and 1e-5)" if r.get("flagged") else ""
    return (f"{head} {r['ms']:.3f} | {_num(r.get('speedup'), '.2f', 'x')} | {_num(r['top1_eager'], '.2f')} | "
            f"{_num(r['top1_fp64'], '.2f')} | {r['rel_err']:.2e} | {_num(r.get('err_ratio'), '.2f', 'x')} | {note} |")


def table(rows: list[dict]) -> list[str]:
    return (["| network | cell | batch | variant | ms | speedup | top-1 = eager | top-1 = fp64 | rel err | "
             "x eager's | note |", "|---|---|---|---|---|---|---|---|---|---|---|"] + [_fmt_row(r) for r in rows])


def geomeans(rows: list[dict]) -> list[dict]:
    """Per (cell, batch, variant, and training step or not) other than eager: the geometric mean
    of the networks' speedups, how many networks it covers, and the slowest network."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if "speedup" in r and r["variant"] != "eager":
            groups.setdefault((r["cell"], r["batch"], r["variant"], bool(r.get("train"))), []).append(r)
    out = []
    for (cell, batch, variant, train), rs in groups.items():
        worst = min(rs, key=lambda r: r["speedup"])
        out.append(dict(cell=cell, batch=batch, variant=variant, train=train, networks=len(rs),
                        geomean=_geomean(r["speedup"] for r in rs), worst=[worst["network"], worst["speedup"]],
                        flagged=sum(bool(r.get("flagged")) for r in rs)))
    return out


def geomean_table(summary: list[dict]) -> list[str]:
    lines = ["| cell | batch | variant | networks | geomean speedup | slowest | flagged |",
             "|---|---|---|---|---|---|---|"]
    return lines + [f"| {s['cell']} | {s['batch']}{' train' if s.get('train') else ''} | {s['variant']} | "
                    f"{s['networks']} | {s['geomean']:.2f}x | "
                    f"{s['worst'][0]} {s['worst'][1]:.2f}x | {s['flagged']} |" for s in summary]


def plot(rows: list[dict], path: str, title: str) -> bool:
    """A bar chart of the speedups over eager, one panel per (cell, batch); False (and a message)
    where matplotlib cannot be imported."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        print(f"# --plot: matplotlib cannot be imported ({exc}); no chart written", flush=True)
        return False
    rows = [r for r in rows if "speedup" in r and r["variant"] != "eager"]
    panels = list(dict.fromkeys((r["cell"], r["batch"]) for r in rows))
    fig, axes = plt.subplots(max(1, len(panels)), 1, figsize=(11, 3.2 * max(1, len(panels))), squeeze=False)
    for ax, (cell, batch) in zip(axes[:, 0], panels):
        rs = [r for r in rows if (r["cell"], r["batch"]) == (cell, batch)]
        nets = list(dict.fromkeys(r["network"] for r in rs))
        names = list(dict.fromkeys(r["variant"] for r in rs))
        width = 0.8 / len(names)
        speed = {(r["network"], r["variant"]): r["speedup"] for r in rs}
        for i, v in enumerate(names):
            ax.bar([j + (i - (len(names) - 1) / 2) * width for j in range(len(nets))],
                   [speed.get((n, v), 0.0) for n in nets], width, label=v)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(nets)), nets)
        ax.set_ylabel("speedup over eager")
        ax.set_title(f"{cell}, batch {batch}")
    axes[0, 0].legend(fontsize="small", ncol=3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"# wrote {path}", flush=True)
    return True


def _write_json(path: str, result: dict) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    os.replace(tmp, path)  # a run cut while writing keeps the previous whole file


def _tf32_settings() -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # newer torch warns on reading the allow_tf32 flags
        return dict(cudnn_allow_tf32=torch.backends.cudnn.allow_tf32,
                    matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32,
                    float32_matmul_precision=torch.get_float32_matmul_precision())


def header(args, variants: list[Variant]) -> dict:
    cuda = args.device == "cuda"
    device = torch.cuda.get_device_name() if cuda else f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
    return dict(device=device, device_kind=args.device, torch=torch.__version__, cuda=torch.version.cuda,
                cudnn=torch.backends.cudnn.version() if cuda else None, kernelgen=kernelgen.__version__,
                kernelgen_commit=_commit(), tf32=_tf32_settings(), fuse_available=fuse_available(),
                cudnn_benchmark=torch.backends.cudnn.benchmark, networks=args.networks, cells=args.cells,
                batches=args.batches, train=args.train, image=args.image, seed=args.seed,
                variants=[v.name for v in variants],
                timing=dict(rounds=args.rounds, reps=args.reps, warmup=args.warmup), budget_s=args.budget_s,
                rows=[], warm=[], not_run=[], geomeans=[])


def _progress(r: dict) -> str:
    head = f"{r['network']:20} {r['cell']:9} b{r['batch']:<3}{' train' if r.get('train') else ''} {r['variant']:18}"
    if "error" in r:
        return f"{head} ERROR {r['error'][:200]}"
    if "skipped" in r:
        return f"{head} skipped: {r['skipped']}"
    return (f"{head} {r['ms']:8.3f} ms {_num(r.get('speedup'), '.2f', 'x'):>6}  top-1 {_num(r['top1_eager'], '.2f')}"
            f"  err {r['rel_err']:.2e} ({_num(r.get('err_ratio'), '.2f', 'x')} eager's)"
            f"{'  FLAG' if r.get('flagged') else ''}")


def run(args, variants: list[Variant]) -> dict:
    result = header(args, variants)
    print(f"# {result['device']}; torch {result['torch']}; kernelgen {result['kernelgen_commit']}; "
          f"tf32 {result['tf32']}; variants {result['variants']}", flush=True)
    if args.device == "cpu":
        print("# CPU path: a smoke check of the script. kernelgen's CPU kernels exist for correctness; "
              "these timings are not meaningful", flush=True)
    end = time.monotonic() + args.budget_s
    longest = 0.0
    try:
        for cell in args.cells:
            for batch in args.batches:
                for name in args.networks:
                    if end - time.monotonic() <= longest:  # it would likely run past the budget
                        result["not_run"].append(dict(network=name, cell=cell, batch=batch))
                        continue
                    t0 = time.monotonic()
                    try:
                        rows, warm = (run_train_group if args.train else run_group)(name, cell, batch, variants,
                                                                                     args, end)
                    except ContextLost:
                        raise
                    except Exception as exc:  # building the network itself failed: one row says so
                        rows, warm = [dict(network=name, cell=cell, batch=batch, variant="eager",
                                           error=_error(exc))], {}
                    finally:
                        _release()
                    result["rows"] += rows
                    result["warm"].append(dict(network=name, cell=cell, batch=batch, **warm))
                    for r in rows:
                        print(_progress(r), flush=True)
                    longest = max(longest, time.monotonic() - t0)
                    result["geomeans"] = geomeans(result["rows"])
                    if args.json:
                        _write_json(args.json, result)
    except ContextLost as exc:
        print(f"# the CUDA context is lost, so nothing more can run: {exc}", flush=True)
        result["context_lost"] = str(exc)
    if result["not_run"]:
        print(f"# not run for the time budget: {len(result['not_run'])} (network, cell, batch)", flush=True)
    if args.json:
        _write_json(args.json, result)
    return result


def show(result: dict) -> None:
    print()
    print("\n".join(table(result["rows"])))
    print()
    print("\n".join(geomean_table(result["geomeans"])))


def report_files(paths: list[str], plot_path: str | None) -> int:
    """The table and geometric means of saved runs (rows of later files replace the same rows of
    earlier ones); no device needed."""
    merged: dict[tuple, dict] = {}
    for p in paths:
        saved = json.loads(Path(p).read_text())
        print(f"# {p}: {saved['device']}; torch {saved['torch']}; kernelgen {saved['kernelgen_commit']}")
        for r in saved["rows"]:
            merged[(r["network"], r["cell"], r["batch"], r["variant"], bool(r.get("train")))] = r
    rows = list(merged.values())
    show(dict(rows=rows, geomeans=geomeans(rows)))
    if plot_path:
        plot(rows, plot_path, "speedup over eager cuDNN")
    return 0


def _list(text: str, allowed, what: str, ap) -> list[str]:
    values = [v for v in text.split(",") if v]
    bad = [v for v in values if v not in allowed]
    if bad:
        ap.error(f"unknown {what} {bad}; choose from {list(allowed)}")
    return values


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--networks", help=f"comma-separated, of {list(NETWORKS)} (default: all on a GPU), or "
                                       f"'{TINY}': a small network for the CPU smoke check (the CPU's default)")
    ap.add_argument("--cells", default=",".join(CELLS), help="fp32-nchw, bf16-cl or both")
    ap.add_argument("--batches", help=f"batch sizes (default {','.join(map(str, BATCHES))}; --train "
                                      f"{','.join(map(str, TRAIN_BATCHES))}); batch 1 is captured in a CUDA graph on "
                                      "a GPU, except for --train")
    ap.add_argument("--train", action="store_true", help="time a training step (module docstring)")
    ap.add_argument("--variants", help="comma-separated (default: all; eager is always run): "
                                       + ", ".join(v.name for v in all_variants(True)))
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                    help="include the torch.compile variants (slow to compile)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--image", type=int, default=224)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3, help="timing rounds (the variants take turns)")
    ap.add_argument("--reps", type=int, default=10, help="timed forwards of each variant a round")
    ap.add_argument("--warmup", type=int, default=5, help="untimed forwards of each variant first")
    ap.add_argument("--budget-s", type=float, default=540, help="stop starting networks past this wall time")
    ap.add_argument("--json", help="write everything here (rewritten after each network)")
    ap.add_argument("--plot", help="write a bar chart of the speedups here (.svg), if matplotlib is importable")
    ap.add_argument("--report", nargs="+", metavar="JSON", help="print the tables of saved runs and exit; no GPU")
    args = ap.parse_args(argv)
    if args.report:
        return report_files(args.report, args.plot)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is visible (--device cpu runs the CPU smoke check)")
    args.networks = _list(args.networks or (",".join(NETWORKS) if args.device == "cuda" else TINY),
                          (*NETWORKS, TINY), "network", ap)
    args.cells = _list(args.cells, CELLS, "cell", ap)
    try:
        args.batches = [int(b) for b in (args.batches or ",".join(map(str, TRAIN_BATCHES if args.train else BATCHES)))
                        .split(",") if b]
    except ValueError:
        ap.error(f"--batches: expected comma-separated integers, got {args.batches!r}")
    known = all_variants(fuse_available(), args.train)
    chosen = set(_list(args.variants, [v.name for v in known], "variant (for this kernelgen)", ap)
                 if args.variants else [v.name for v in known]) | {"eager"}
    variants = [v for v in known if v.name in chosen and (args.compile or not v.compiled)]
    if any(n != TINY for n in args.networks):
        try:
            _torchvision()
        except ImportError as exc:
            ap.error(str(exc))
    result = run(args, variants)
    show(result)
    if args.plot:
        plot(result["rows"], args.plot, f"speedup over eager cuDNN, {result['device']}")
    bad = [r for r in result["rows"] if "error" in r or r.get("flagged")]
    return 1 if bad or "context_lost" in result else 0


if __name__ == "__main__":
    sys.exit(main())
