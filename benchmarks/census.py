"""A census of convolution layers nobody tuned by hand: kernelgen beside F.conv2d on a seeded sample.

bench_layers.py times 28 layers that kernelgen's dispatch was written around; a tuned benchmark
says little about the next network. This script draws a seeded random sample of layers from
weights modelled on what torchvision's and timm's networks contain (1x1s, k x k, asymmetric,
first layers, strided, dilated, grouped, depthwise, squeeze-excitation; batches 1-64, planes
1-224, channel counts typical and odd) and times each in six cells (precision tf32, ieee, bf16
x memory format nchw, cl) with bench_layers.py's back-to-back "stream" timing, checking each
output against float64 by the accuracy rules of docs/performance.md.

    python benchmarks/census.py [--seed 0] [--n 320] [--cells tf32-nchw,bf16-cl,...] [--budget-s 480]
                                [--tune] [--top 4] [--networks] [--json out.json] [--list]

`--list` prints the sample and needs no GPU. `--budget-s` bounds the whole run's wall time: each
cell gets an equal share of what is left (its compiles included), takes its layers in a seeded
shuffled order and stops starting new ones when its share is spent, so a cut run is still an
unbiased sample. `--tune` gives half of each share to kernelgen.tune_calls, where it exists.
`--networks` adds the distinct layers of networks.py's six networks at batch 1 and 32.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import bench_layers  # noqa: E402
import kernelgen  # noqa: E402
from bench_cases import Case, paired_ms, rel_err, set_tf32  # noqa: E402

CELLS = tuple(f"{p}-{f}" for p in bench_layers.PRECISIONS for f in bench_layers.FORMATS)

# One layer's tensors stay under 400 MB of float32 and its work under 20 GFLOP (a few ms in strict
# float32 on an H100): a drawn layer over either is cut to a smaller batch, or drawn again.
MAX_ELEMENTS = 100_000_000
MAX_FLOPS = 20e9


def _pair(v) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else tuple(v)


def out_size(hw, kernel, stride=1, padding=0, dilation=1) -> tuple[int, int]:
    """F.conv2d's output plane (P, Q) for an input plane `hw`; padding may be 'same' or 'valid'."""
    if padding == "same":
        return tuple(hw)
    pad = (0, 0) if padding == "valid" else _pair(padding)
    return tuple((x + 2 * p - d * (k - 1) - 1) // s + 1
                 for x, k, s, p, d in zip(hw, kernel, _pair(stride), pad, _pair(dilation)))


@dataclass(frozen=True)
class Layer(Case):
    """bench_cases' Case with dilation and a bias; stride, padding and dilation an int or an (h, w) pair."""

    dilation: int | tuple[int, int] = 1
    bias: bool = False

    def kwargs(self) -> dict:
        return dict(stride=self.stride, padding=self.padding, dilation=self.dilation, groups=self.groups)

    def out_size(self) -> tuple[int, int]:
        return out_size((self.H, self.W), self.kernel, self.stride, self.padding, self.dilation)

    def flops(self) -> int:
        P, Q = self.out_size()
        return 2 * self.N * self.K * P * Q * (self.C // self.groups) * self.kernel[0] * self.kernel[1]

    def kind(self) -> str:
        """The class of layer, from its shape alone (so network layers are classed as drawn ones are)."""
        kh, kw = self.kernel
        if self.groups > 1:
            return "depthwise" if self.groups == self.C else "grouped"
        if self.C <= 4:
            return "stem"
        if max(_pair(self.dilation)) > 1:
            return "dilated"
        if kh != kw:
            return "asym"
        if max(_pair(self.stride)) > 1:
            return "strided"
        if kh == 1:
            return "se" if (self.H, self.W) == (1, 1) else "1x1"
        return "kxk"


def valid(layer: Layer) -> bool:
    """Whether F.conv2d takes the layer: groups divide both channel counts, the output is >= 1x1."""
    return layer.C % layer.groups == 0 and layer.K % layer.groups == 0 and min(layer.out_size()) >= 1


def _fits(layer: Layer) -> bool:
    P, Q = layer.out_size()
    return (layer.N * layer.C * layer.H * layer.W <= MAX_ELEMENTS and layer.N * layer.K * P * Q <= MAX_ELEMENTS
            and layer.flops() <= MAX_FLOPS)


# ------------------------------------------------------------------------------------ the sample

# (value, weight) tables. Batches favour inference (1) and training (8-32); planes the stages of an
# ImageNet network (56 ... 7), with some of Inception's and detectors' odd sizes.
BATCHES = ((1, 24), (8, 14), (16, 14), (32, 18), (64, 5), (2, 4), (4, 5), (3, 3), (5, 2), (12, 1), (24, 2))
PLANES = ((7, 16), (14, 16), (28, 16), (56, 14), (112, 6), (224, 2), (2, 1), (4, 2), (10, 1), (13, 3), (17, 3),
          (19, 2), (35, 3), (73, 2), (150, 1))
TYPICAL = (16, 24, 32, 48, 64, 96, 128, 144, 160, 192, 256, 320, 384, 480, 512, 576, 640, 768, 960, 1024, 1280,
           1536, 2048)
# Widths of EfficientNet, RegNet, ShuffleNet, Inception and pruned networks, most not multiples of 8.
ODD = (12, 20, 36, 40, 44, 58, 72, 75, 100, 116, 120, 174, 185, 300, 906, 972, 1044)
DEPTHWISE = (16, 24, 32, 40, 48, 58, 72, 96, 116, 120, 144, 192, 232, 240, 288, 384, 480, 576, 672, 768, 960, 1152)
# (kernel, stride, padding, output channels, bias): VGG, ResNet, MobileNet, AlexNet, ConvNeXt's patchify.
STEMS = (((3, 2, 1, (16, 24, 32, 48, 64), None), 35), ((7, 2, 3, (64, 32), None), 30),
         ((11, 4, 2, (64, 96), True), 12), ((4, 4, 0, (96, 128), True), 15), ((3, 1, 1, (64, 32), None), 8))
KINDS = (("1x1", 23), ("se", 5), ("kxk", 16), ("asym", 4), ("stem", 5), ("strided", 10), ("dilated", 5),
         ("grouped", 14), ("depthwise", 18))


def _pick(rng: random.Random, table):
    values, weights = zip(*table)
    return rng.choices(values, weights)[0]


def _form(rng: random.Random, h: int, w: int):
    """An int or an (h, w) pair, as networks write them: a pair when they differ, sometimes when not."""
    return h if h == w and rng.random() < 0.75 else (h, w)


def _hw(rng: random.Random) -> tuple[int, int]:
    H = _pick(rng, PLANES)
    return H, (H if rng.random() >= 0.08 else max(1, round(H * rng.choice((0.5, 0.75, 1.5, 2)))))


def _channels(rng: random.Random, plane: int) -> int:
    """A channel count for a layer on this plane: networks widen as they downsample (64 at 56x56,
    2048 at 7x7); three draws in ten come from the odd widths."""
    hi = min(2048, 14336 // plane)
    return rng.choice([c for c in (ODD if rng.random() < 0.3 else TYPICAL) if c <= hi])


def _out_channels(rng: random.Random, C: int, plane: int) -> int:
    opts = (C, C, 2 * C, 4 * C, 6 * C, max(8, C // 4), max(8, C // 6), _channels(rng, plane))
    return rng.choice([k for k in opts if k <= 2048])


def _dense_1x1(rng):
    H, W = _hw(rng)
    C = _channels(rng, H)
    return dict(C=C, K=_out_channels(rng, C, H), H=H, W=W, kernel=(1, 1), bias=rng.random() < 0.2)


def _se(rng):
    # Squeeze-excitation: 1x1 on the pooled 1x1 plane, width -> width/4 (/16 in SE-ResNet) and back.
    width = rng.choice((64, 72, 96, 120, 144, 240, 256, 480, 512, 672, 696, 888, 960, 1024, 1152, 1232, 2048))
    mid = max(8, width // rng.choice((4, 4, 16)))
    C, K = (width, mid) if rng.random() < 0.5 else (mid, width)
    return dict(C=C, K=K, H=1, W=1, kernel=(1, 1), bias=True)


def _dense_kxk(rng):
    k = _pick(rng, ((3, 80), (5, 12), (7, 8)))
    H, W = _hw(rng)
    C = _channels(rng, H)
    return dict(C=C, K=_out_channels(rng, C, H), H=H, W=W, kernel=(k, k), padding=_form(rng, k // 2, k // 2),
                bias=rng.random() < 0.25)


def _asym(rng):
    # Inception's factorised 7x7 (17x17 planes) and 3x3 (8x8), and separable-filter layers elsewhere.
    kh, kw = rng.choice(((1, 7), (7, 1), (1, 3), (3, 1)))
    H = rng.choice((8, 17, 17, 35, 14, 28))
    C = rng.choice((128, 160, 192, 384, 448, 768, _channels(rng, H)))
    return dict(C=C, K=rng.choice((C, 192, 256, 384)), H=H, W=H, kernel=(kh, kw), padding=(kh // 2, kw // 2),
                bias=rng.random() < 0.2)


def _stem(rng):
    k, s, p, outs, bias = _pick(rng, STEMS)
    H = _pick(rng, ((224, 14), (192, 2), (160, 2), (128, 1), (96, 1)))
    return dict(C=3, K=rng.choice(outs), H=H, W=H, kernel=(k, k), stride=s, padding=p,
                bias=rng.random() < 0.2 if bias is None else bias)


def _strided(rng):
    H, W = _hw(rng)
    C = _channels(rng, H)
    k, s, p = _pick(rng, (((3, 2, 1), 55), ((1, 2, 0), 25), ((2, 2, 0), 10), ((3, 3, 1), 2), ((1, 3, 0), 2),
                          ((1, 4, 0), 3), ((3, 4, 1), 3)))
    K = rng.choice([c for c in (C, 2 * C, 4 * C if k == 1 else C) if c <= 2048])
    return dict(C=C, K=K, H=H, W=W, kernel=(k, k), stride=_form(rng, s, s), padding=_form(rng, p, p),
                bias=k == 2 or rng.random() < 0.15)  # 2x2 stride 2: ConvNeXt's downsampling, with a bias


def _dilated(rng):
    # DeepLab's atrous 3x3s: padding = dilation keeps the plane.
    d = rng.choice((2, 2, 3, 4))
    H, W = _hw(rng)
    C = _channels(rng, H)
    return dict(C=C, K=rng.choice((C, 256, _channels(rng, H))), H=H, W=W, kernel=(3, 3), padding=_form(rng, d, d),
                dilation=_form(rng, d, d), bias=rng.random() < 0.2)


def _grouped(rng):
    style = _pick(rng, (("resnext", 45), ("regnet", 35), ("other", 20)))
    k, K = 3, None
    if style == "resnext":  # 32 (64) groups of 4, 8, 16, 32 channels at stages 56, 28, 14, 7
        groups, per = rng.choice((32, 32, 64)), rng.choice((4, 8, 16, 32))
        H = {4: 56, 8: 28, 16: 14, 32: 7}[per] if rng.random() < 0.7 else _pick(rng, PLANES)
    elif style == "regnet":  # a stage width rounded to its group width: 2-64 groups, odd counts too
        per = rng.choice((8, 16, 24, 32, 48, 56, 64))
        width = rng.choice((48, 56, 104, 120, 152, 208, 232, 336, 368, 440, 576, 696, 784, 888, 912, 1232))
        groups = min(64, max(2, round(width / per)))
        H = next(h for w, h in ((64, 56), (152, 28), (440, 14), (10 ** 9, 7)) if width <= w)
    else:  # ShuffleNet's grouped 1x1s, and grouped k x k of few groups
        groups = rng.choice((2, 3, 4, 6, 8, 12, 16))
        per = rng.choice((4, 6, 8, 12, 16, 20, 24, 40, 48, 64))
        k, H = rng.choice((1, 3, 3, 5)), _pick(rng, PLANES)
        K = rng.choice((groups * per, 2 * groups * per))
    C = groups * per
    return dict(C=C, K=K or C, H=H, W=H, kernel=(k, k), stride=1 if rng.random() < 0.8 else 2,
                padding=_form(rng, k // 2, k // 2), groups=groups, bias=rng.random() < 0.1)


def _depthwise(rng):
    H, W = _hw(rng)
    C = rng.choice([c for c in DEPTHWISE if c <= 3 * min(2048, 14336 // H)])  # expanded: ~3x a dense width
    k = _pick(rng, ((3, 55), (5, 25), (7, 20)))
    return dict(C=C, K=2 * C if rng.random() < 0.1 else C, H=H, W=W, kernel=(k, k),
                stride=2 if rng.random() < 0.25 else 1, padding=_form(rng, k // 2, k // 2), groups=C,
                bias=rng.random() < 0.3)


GENERATORS = {"1x1": _dense_1x1, "se": _se, "kxk": _dense_kxk, "asym": _asym, "stem": _stem, "strided": _strided,
              "dilated": _dilated, "grouped": _grouped, "depthwise": _depthwise}


def _tag(layer: Layer) -> str:
    """The short kind in a layer's name: pw, se, 3x3, 1x7, stem7x7.s2, 3x3.d2, g32.3x3, dw5x5.s2.m2."""
    kind, k = layer.kind(), f"{layer.kernel[0]}x{layer.kernel[1]}"
    s, d = max(_pair(layer.stride)), max(_pair(layer.dilation))
    tag = {"se": "se", "stem": f"stem{k}", "grouped": f"g{layer.groups}.{k}", "depthwise": f"dw{k}"}.get(
        kind, "pw" if k == "1x1" else k)
    return (tag + (f".s{s}" if s > 1 else "") + (f".d{d}" if d > 1 else "")
            + (f".m{layer.K // layer.C}" if kind == "depthwise" and layer.K > layer.C else ""))


def draw(rng: random.Random, kind: str, index: int) -> Layer:
    """One valid layer of `kind`, its batch halved until it fits the size caps, else drawn again."""
    while True:
        layer = Layer(name="", N=_pick(rng, BATCHES), **GENERATORS[kind](rng))
        while not _fits(layer) and layer.N > 1:
            layer = replace(layer, N=layer.N // 2)
        if valid(layer) and _fits(layer):
            return replace(layer, name=f"c{index:04d}.{_tag(layer)}")


def _kinds(rng: random.Random, n: int) -> list[str]:
    """`n` kinds in the proportions of KINDS (largest remainders), shuffled: every kind occurs in
    a sample of 20 or more, whatever the seed."""
    total = sum(w for _, w in KINDS)
    exact = [(kind, n * w / total) for kind, w in KINDS]
    counts = {kind: int(x) for kind, x in exact}
    for kind, _ in sorted(exact, key=lambda e: int(e[1]) - e[1])[:n - sum(counts.values())]:
        counts[kind] += 1
    kinds = [kind for kind, c in counts.items() for _ in range(c)]
    rng.shuffle(kinds)
    return kinds


def layers(seed: int = 0, n: int = 320) -> list[Layer]:
    """`n` layers drawn with random.Random(seed): the same list for the same seed."""
    rng = random.Random(seed)
    return [draw(rng, kind, i) for i, kind in enumerate(_kinds(rng, n))]


def network_sample() -> list[Layer]:
    """networks.py's distinct layers at batch 1 and 32 (needs torchvision)."""
    from networks import distinct_layers

    return [replace(layer, name=f"{layer.name}.b{batch}")
            for batch in (1, 32) for layer in distinct_layers(batch=batch)]


def _text(v) -> str:
    return str(v) if isinstance(v, (int, str)) else ",".join(map(str, v))


def describe(layer: Layer) -> str:
    P, Q = layer.out_size()
    kh, kw = layer.kernel
    return (f"{layer.name:34} N={layer.N:<3} {layer.C:>4}->{layer.K:<4} {layer.H}x{layer.W}->{P}x{Q} k{kh}x{kw} "
            f"s{_text(layer.stride)} p{_text(layer.padding)} d{_text(layer.dilation)} g{layer.groups}"
            f"{' bias' if layer.bias else ''}  {layer.flops() / 1e9:.2f} GFLOP")


def histogram(sample: list[Layer]) -> str:
    counts = Counter(layer.kind() for layer in sample)
    return f"{len(sample)} layers: " + ", ".join(f"{kind} {counts[kind]}" for kind, _ in KINDS)


# ------------------------------------------------------------------------------------ timing


class ContextLost(RuntimeError):
    """The CUDA context is broken (an illegal address, a launch failure): nothing more runs in this process."""


def _check_alive() -> None:
    try:
        torch.cuda.synchronize()
    except RuntimeError as exc:
        raise ContextLost(str(exc)) from exc


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


def _precision(precision: str) -> str | None:
    return None if precision == "bf16" else precision  # bf16 has one math; float32 says which


def _tensors(layer: Layer, precision: str, fmt: str, device: str):
    """bench_layers' input and weight, and a bias in their dtype when the layer has one."""
    x, w = bench_layers._tensors(layer, precision, fmt, device)
    if not layer.bias:
        return x, w, None
    if device == "meta":
        return x, w, torch.empty(layer.K, device="meta", dtype=w.dtype)
    g = torch.Generator(device=device).manual_seed(1)
    return x, w, (torch.rand(layer.K, device=device, generator=g) - 0.5).to(w.dtype)


def warm(sample: list[Layer], precision: str, fmt: str, jobs: int) -> dict[str, str]:
    """Compiles the kernels of `sample` in parallel, as bench_layers.warm does; {layer name: why it cannot run}."""
    from kernelgen.functional import spec_for
    from kernelgen.warm import warm_specs

    users, failed = {}, {}
    for layer in sample:
        try:
            x, w, b = _tensors(layer, precision, fmt, "meta")
            spec, _ = spec_for(x, w, b, **layer.kwargs(), device="cuda", precision=_precision(precision))
        except Exception as exc:  # conv2d would raise the same: the layer's row says so
            failed[layer.name] = _error(exc)
            continue
        users.setdefault(spec, []).append(layer.name)
    for r in warm_specs(sorted(users, key=lambda s: s.to_json()), jobs=jobs):
        if r.status == "failed":
            failed.update((name, f"compile failed: {r.message}"[:500]) for name in users.get(r.spec, ()))
    return failed


def _measure(layer: Layer, precision: str, fmt: str, x, w, b) -> dict:
    """kernelgen's stream time beside F.conv2d's (bench_layers.stream_pair), and kernelgen's error
    on the first two images against float64 with bench_layers.accuracy_bound."""
    pr, kw = _precision(precision), layer.kwargs()
    fk = lambda: kernelgen.conv2d(x, w, b, precision=pr, **kw)  # noqa: E731
    ft = lambda: F.conv2d(x, w, b, **kw)  # noqa: E731
    y = fk()
    n = min(layer.N, 2)
    ref = F.conv2d(x[:n].double(), w.double(), None if b is None else b.double(), **kw)
    err, torch_err = rel_err(y[:n], ref), rel_err(F.conv2d(x[:n], w, b, **kw), ref)
    bound, rule = bench_layers.accuracy_bound(precision, x[:n], w, b, kw, ref, torch_err)
    layout = torch.channels_last if fmt == "cl" else torch.contiguous_format
    accurate = bool(torch.isfinite(y).all()) and err <= bound and y.is_contiguous(memory_format=layout)
    del y, ref
    kg_ms, torch_ms = paired_ms(fk, ft, rounds=2, reps=10)  # latencies: stream_pair's yardstick
    kg, tt, tries = bench_layers.stream_pair(fk, ft, kg_ms, torch_ms)
    return dict(kernelgen_ms=kg_ms, torch_ms=torch_ms, kernelgen_stream_ms=kg, torch_stream_ms=tt, speedup=tt / kg,
                stream_tries=tries, rel_err=err, torch_rel_err=torch_err, accuracy_rule=rule, accurate=accurate)


def measure(layer: Layer, precision: str, fmt: str) -> dict:
    set_tf32(precision != "ieee")
    x, w, b = _tensors(layer, precision, fmt, "cuda")
    spec = kernelgen.functional.spec_for(x, w, b, precision=_precision(precision), **layer.kwargs())[0]
    return dict(family=spec.family, spec=spec.summary(), **_measure(layer, precision, fmt, x, w, b))


def run_cell(sample: list[Layer], cell: str, seed: int, until: float, jobs: int, rows: list[dict]) -> None:
    """Appends a row per layer of `sample` measured in `cell` before time.monotonic() reaches `until`."""
    precision, fmt = cell.split("-")
    order = list(sample)
    random.Random(f"{seed}/{cell}").shuffle(order)
    done = 0
    try:
        # Compiled in chunks of four layers a worker, each just before its layers are timed, so that a
        # spent budget stops the compiles too (a cold cache can take longer than a cell's share).
        for start in range(0, len(order), 4 * jobs):
            if time.monotonic() >= until:
                break
            part = order[start:start + 4 * jobs]
            t0 = time.perf_counter()
            failed = warm(part, precision, fmt, jobs)
            print(f"# {cell}: compiled the kernels of {len(part)} layers in {time.perf_counter() - t0:.0f} s",
                  flush=True)
            for layer in part:
                if time.monotonic() >= until:
                    break
                row = dict(asdict(layer), kind=layer.kind(), cell=cell, precision=precision, format=fmt)
                rows.append(row)
                done += 1
                if layer.name in failed:
                    row["error"] = failed[layer.name]
                else:
                    try:
                        row.update(measure(layer, precision, fmt))
                    except Exception as exc:  # one broken layer must not hide the others' numbers
                        row["error"] = _error(exc)
                        _check_alive()
                torch.cuda.empty_cache()
                print(_progress(row), flush=True)
    finally:
        print(f"# covered {done} of {len(sample)} layers in cell {cell}", flush=True)


def _progress(row: dict) -> str:
    head = f"{row['cell']:9} {row['name']:34}"
    if "error" in row:
        return f"{head} ERROR {row['error'][:160]}"
    return (f"{head} {row['family']:16} {row['kernelgen_stream_ms']:.4f} / {row['torch_stream_ms']:.4f} ms "
            f"{row['speedup']:.2f}x {'ok' if row['accurate'] else 'INACCURATE'}")


def _batches(rows: list[dict], by_name: dict[str, Layer], budget_bytes: float = 8e9, most: int = 16):
    """Rows in groups whose tensors together stay under `budget_bytes` (tune_calls takes real tensors)."""
    part, size = [], 0
    for r in rows:
        layer = by_name[r["name"]]
        P, Q = layer.out_size()
        nbytes = 4 * (layer.N * layer.C * layer.H * layer.W + layer.N * layer.K * P * Q)
        if part and (size + nbytes > budget_bytes or len(part) == most):
            yield part
            part, size = [], 0
        part.append(r)
        size += nbytes
    if part:
        yield part


def tune_cell(rows: list[dict], by_name: dict[str, Layer], cell: str, until: float, top: int, jobs: int) -> None:
    """kernelgen.tune_calls on the measured layers of `cell`, then their stream times again beside
    F.conv2d's (conv2d runs the tuned choice), as tuned_* fields of their rows."""
    precision, fmt = cell.split("-")
    todo = [r for r in rows if r["cell"] == cell and "error" not in r]
    for part in _batches(todo, by_name):
        if time.monotonic() >= until:
            break
        set_tf32(precision != "ieee")
        layers_ = [by_name[r["name"]] for r in part]
        tensors = [_tensors(layer, precision, fmt, "cuda") for layer in layers_]
        calls = [dict(input=x, weight=w, bias=b, **layer.kwargs(), precision=_precision(precision))
                 for layer, (x, w, b) in zip(layers_, tensors)]
        try:
            results = kernelgen.tune_calls(calls, top=top, jobs=jobs)
        except Exception as exc:
            for r in part:
                r["tune_error"] = _error(exc)
            _check_alive()
            continue
        for r, layer, t, res in zip(part, layers_, tensors, results):
            try:
                m = _measure(layer, precision, fmt, *t)
                r.update(tuned_family=res.spec.family, tuned_spec=res.spec.summary(), tuned_timings=list(res.timings),
                         tuned_stream_ms=m["kernelgen_stream_ms"], tuned_torch_stream_ms=m["torch_stream_ms"],
                         tuned_speedup=m["speedup"], tuned_rel_err=m["rel_err"], tuned_accurate=m["accurate"])
            except Exception as exc:
                r["tune_error"] = _error(exc)
                _check_alive()
        del tensors, calls
        torch.cuda.empty_cache()
    print(f"# tuned {sum('tuned_speedup' in r for r in todo)} of {len(todo)} measured layers in cell {cell}",
          flush=True)


# ------------------------------------------------------------------------------------ summary


def _stats(rows: list[dict], prefix: str = "") -> dict | None:
    """Geomean speedup, share at >= 0.95x, worst three and per-family figures of rows with `prefix`speedup."""
    rows = [r for r in rows if prefix + "speedup" in r]
    if not rows:
        return None
    speedup = lambda r: r[prefix + "speedup"]  # noqa: E731
    families: dict[str, list[float]] = {}
    for r in rows:
        families.setdefault(r[prefix + "family"], []).append(speedup(r))
    return dict(measured=len(rows), inaccurate=sum(not r[prefix + "accurate"] for r in rows),
                geomean=bench_layers._geomean(map(speedup, rows)),
                at_least_0_95=sum(speedup(r) >= 0.95 for r in rows) / len(rows),
                worst=[[r["name"], speedup(r), r[prefix + "family"]] for r in sorted(rows, key=speedup)[:3]],
                families={f: dict(count=len(v), geomean=bench_layers._geomean(v)) for f, v in sorted(families.items())})


def summarize(rows: list[dict], cells, total: int) -> dict:
    out = {}
    for cell in cells:
        rs = [r for r in rows if r["cell"] == cell]
        out[cell] = dict(layers=total, covered=len(rs), errors=sum("error" in r for r in rs), untuned=_stats(rs),
                         tuned=_stats(rs, "tuned_"))
    return out


def summary_lines(summary: dict) -> list[str]:
    lines = ["| cell | covered | errors | measured | inaccurate | stream geomean | >= 0.95x | worst |",
             "|---|---|---|---|---|---|---|---|"]
    families = ["| cell | family | layers | stream geomean |", "|---|---|---|---|"]
    for cell, s in summary.items():
        for label, st in ((cell, s["untuned"]), (f"{cell} tuned", s["tuned"])):
            if st is None:
                if label == cell:
                    lines.append(f"| {cell} | {s['covered']} of {s['layers']} | {s['errors']} | 0 | | | | |")
                continue
            worst = ", ".join(f"{name} {x:.2f}x ({fam})" for name, x, fam in st["worst"])
            lines.append(f"| {label} | {s['covered']} of {s['layers']} | {s['errors']} | {st['measured']} | "
                         f"{st['inaccurate']} | {st['geomean']:.2f}x | {100 * st['at_least_0_95']:.0f}% | {worst} |")
            families += [f"| {label} | {fam} | {f['count']} | {f['geomean']:.2f}x |"
                         for fam, f in st["families"].items()]
    return lines + [""] + families


def _commit() -> str | None:
    """The checkout's commit, with '+dirty' where its tracked files differ from it (a copy of a
    working tree whose changes are not committed, as the GPU host receives: the results then came
    from that commit plus changes the record does not hold)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        clean = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=ROOT, capture_output=True).returncode == 0
        return head if clean else head + "+dirty"
    except (OSError, subprocess.CalledProcessError):
        return None


def run(sample: list[Layer], cells: list[str], args) -> int:
    jobs = int(os.environ.get("KERNELGEN_JOBS", "0")) or os.cpu_count() or 1
    print(f"# {torch.cuda.get_device_name()}; torch {torch.__version__}; {histogram(sample)}; seed {args.seed}",
          flush=True)
    tune = args.tune and hasattr(kernelgen, "tune_calls")
    if args.tune and not tune:
        print("# tuning is unavailable (this kernelgen has no tune_calls): untuned timings only", flush=True)
    by_name = {layer.name: layer for layer in sample}
    rows: list[dict] = []
    end = time.monotonic() + args.budget_s
    try:
        for i, cell in enumerate(cells):
            now = time.monotonic()
            share = (end - now) / (len(cells) - i)  # what a cell leaves unused goes to the cells after it
            run_cell(sample, cell, args.seed, now + (share / 2 if tune else share), jobs, rows)
            if tune:
                tune_cell(rows, by_name, cell, now + share, args.top, jobs)
    except ContextLost as exc:
        print(f"# the CUDA context is lost, so nothing more can run: {exc}", flush=True)
    set_tf32(True)
    summary = summarize(rows, cells, len(sample))
    print()
    print("\n".join(summary_lines(summary)))
    if args.json:
        Path(args.json).write_text(json.dumps(
            dict(device=torch.cuda.get_device_name(), torch=torch.__version__, kernelgen_commit=_commit(),
                 seed=args.seed, n=args.n, networks=args.networks, budget_s=args.budget_s, cells=cells, rows=rows,
                 summary=summary), indent=1, default=str))
    return 1 if any("error" in r or not r["accurate"] for r in rows) else 0


def compare(paths: list[str]) -> list[str]:
    """A table of several runs' JSON (before and after a change, on one card): per cell, over the
    layers every run that measured the cell has, each run's geometric mean of the stream speedups
    and share of layers at 0.95x or better, untuned, and tuned over the layers it tuned."""
    runs = [{(r["name"], r["cell"]): r for r in json.loads(Path(p).read_text())["rows"] if "speedup" in r}
            for p in paths]
    out = ["| cell | layers | " + " | ".join(Path(p).stem for p in paths) + " |", "|---|---|" + "---|" * len(paths)]
    for cell in CELLS:
        having = [rs for rs in runs if any(k[1] == cell for k in rs)]
        if not having:
            continue
        common = set.intersection(*[{k for k in rs if k[1] == cell} for rs in having])
        if not common:
            continue
        cols = []
        for rs in runs:
            if not any(k[1] == cell for k in rs):
                cols.append("-")
                continue
            text = ""
            for label, field in (("", "speedup"), ("tuned ", "tuned_speedup")):
                vals = [rs[k][field] for k in common if field in rs[k]]
                if vals:
                    share = sum(v >= 0.95 for v in vals) / len(vals)
                    part = "" if len(vals) == len(common) else f" ({len(vals)} layers)"
                    text += f"{'; ' if text else ''}{label}{bench_layers._geomean(vals):.2f}x, {share:.0%}{part}"
            cols.append(text)
        out.append(f"| {cell} | {len(common)} | " + " | ".join(cols) + " |")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n", type=int, default=320, help="layers to draw")
    ap.add_argument("--cells", default=",".join(CELLS), help="precision-format pairs, e.g. tf32-nchw,bf16-cl")
    ap.add_argument("--budget-s", type=float, default=480, help="wall-clock budget of the whole run, compiles included")
    ap.add_argument("--tune", action="store_true", help="also time kernelgen after kernelgen.tune_calls")
    ap.add_argument("--top", type=int, default=4, help="candidates tune_calls times per layer")
    ap.add_argument("--networks", action="store_true", help="add networks.py's distinct layers at batch 1 and 32")
    ap.add_argument("--json", help="write the results here as JSON")
    ap.add_argument("--list", action="store_true", help="print the sample and exit")
    ap.add_argument("--compare", nargs="+", metavar="JSON", help="compare runs' JSON on their common layers; no GPU")
    args = ap.parse_args(argv)
    if args.compare:
        print("\n".join(compare(args.compare)))
        return 0
    cells = args.cells.split(",")
    bad = [c for c in cells if c not in CELLS]
    if bad:
        ap.error(f"unknown cell {bad}; choose from {list(CELLS)}")
    sample = layers(args.seed, args.n)
    if args.networks:
        try:
            sample += network_sample()
        except ImportError as exc:
            ap.error(str(exc))
    if args.list:
        for layer in sample:
            print(describe(layer))
        print(histogram(sample))
        return 0
    if not torch.cuda.is_available():
        print("census.py needs a CUDA device to time layers (--list needs none)", file=sys.stderr)
        return 2
    return run(sample, cells, args)


if __name__ == "__main__":
    sys.exit(main())
