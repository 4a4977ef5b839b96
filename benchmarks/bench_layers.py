"""Layers of real networks in every precision and both memory formats: kernelgen beside F.conv2d.

The five KernelBench cases (bench_cases.py) are large, single layers. A network's layers are
mostly small: 7x7 to 56x56 planes with hundreds of channels, strided 3x3s, 1x1 projections,
depthwise and grouped convolutions, and, in mixed-precision training and inference, channels_last
tensors. This script times kernelgen and F.conv2d on such layers in the same process (medians of
CUDA-event-timed runs in alternating rounds, as bench_cases.py does), checks each output against
float64 by the accuracy rules of docs/performance.md, and prints one table with the family each call ran
on, then a summary per precision and memory format: how many layers kernelgen wins, loses, and
the geometric mean of the speedups.

Two timings, because a small layer's time depends on how it is called:
- `ms` (latency): one call between two events, synchronised after each, as bench_cases.py times.
  The host's work before the launch is inside it, so on layers of tens of microseconds it is
  mostly launch latency, and the two libraries' ratios drift toward 1.
- `stream ms` (throughput): 20 calls queued back to back behind a short GPU sleep, so the host is
  never the limit; the per-call time of the kernels as a network runs them.
`host us` is the host's time per call (the calls only queue: the GPU is kept busy).

    python benchmarks/bench_layers.py [--layers r50.l1.3x3,...] [--precisions tf32,ieee,bf16]
                                      [--formats nchw,cl] [--json out.json] [--list]

`--list` prints the layers and needs no GPU. The kernels are compiled ahead of the timing, in
parallel (`kernelgen.warm.warm_specs`), so the table does not wait on one compile at a time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kernelgen  # noqa: E402
from bench_cases import Case, paired_ms, rel_err, set_tf32, tf32_round  # noqa: E402


def _square(name: str, N: int, C: int, K: int, H: int, W: int, kernel: int, **kw) -> Case:
    """A square-kernel layer, as bench_cases.py's Case (stride, padding, groups by keyword)."""
    return Case(name, N, C, K, H, W, (kernel, kernel), **kw)


def _layers() -> dict[str, Case]:
    rows = [
        # ResNet-50 at batch 32, 224 x 224 input: the stem (3 channels, 7x7 stride 2), the
        # bottleneck's 1x1s and 3x3 of each stage, and the strided 3x3 and 1x1 that open stages 2-4.
        _square("r50.stem", 32, 3, 64, 224, 224, 7, stride=2, padding=3),
        _square("r50.l1.1x1.64-64", 32, 64, 64, 56, 56, 1),
        _square("r50.l1.3x3", 32, 64, 64, 56, 56, 3, padding=1),
        _square("r50.l1.1x1.64-256", 32, 64, 256, 56, 56, 1),
        _square("r50.l1.1x1.256-64", 32, 256, 64, 56, 56, 1),
        _square("r50.l2.3x3.s2", 32, 128, 128, 56, 56, 3, stride=2, padding=1),
        _square("r50.l2.down.s2", 32, 256, 512, 56, 56, 1, stride=2),
        _square("r50.l2.3x3", 32, 128, 128, 28, 28, 3, padding=1),
        _square("r50.l2.1x1.512-128", 32, 512, 128, 28, 28, 1),
        _square("r50.l3.3x3", 32, 256, 256, 14, 14, 3, padding=1),
        _square("r50.l3.1x1.256-1024", 32, 256, 1024, 14, 14, 1),
        _square("r50.l4.3x3", 32, 512, 512, 7, 7, 3, padding=1),
        _square("r50.l4.1x1.2048-512", 32, 2048, 512, 7, 7, 1),
        # ResNeXt-50 32x4d: the grouped 3x3 of each stage, 4, 8, 16 and 32 channels a group.
        _square("rx50.l1.g32", 32, 128, 128, 56, 56, 3, padding=1, groups=32),
        _square("rx50.l2.g32", 32, 256, 256, 28, 28, 3, padding=1, groups=32),
        _square("rx50.l3.g32", 32, 512, 512, 14, 14, 3, padding=1, groups=32),
        _square("rx50.l4.g32", 32, 1024, 1024, 7, 7, 3, padding=1, groups=32),
        # MobileNetV2 at batch 32: the stem (3 channels, 3x3 stride 2), depthwise 3x3s (stride 1
        # and 2) and the 1x1s around them.
        _square("mv2.stem", 32, 3, 32, 224, 224, 3, stride=2, padding=1),
        _square("mv2.dw32.112", 32, 32, 32, 112, 112, 3, padding=1, groups=32),
        _square("mv2.dw96.s2", 32, 96, 96, 112, 112, 3, stride=2, padding=1, groups=96),
        _square("mv2.dw144.56", 32, 144, 144, 56, 56, 3, padding=1, groups=144),
        _square("mv2.dw384.14", 32, 384, 384, 14, 14, 3, padding=1, groups=384),
        _square("mv2.dw960.7", 32, 960, 960, 7, 7, 3, padding=1, groups=960),
        _square("mv2.pw.24-144", 32, 24, 144, 56, 56, 1),
        _square("mv2.pw.144-24", 32, 144, 24, 56, 56, 1),
        # VGG-16's widest planes at batch 8, and a U-Net-style 3x3 on 256 x 256.
        _square("vgg.3x3.64", 8, 64, 64, 224, 224, 3, padding=1),
        _square("vgg.3x3.256", 8, 256, 256, 56, 56, 3, padding=1),
        _square("unet.3x3.64", 4, 64, 64, 256, 256, 3, padding=1),
    ]
    return {layer.name: layer for layer in rows}


LAYERS = _layers()
PRECISIONS = ("tf32", "ieee", "bf16")
FORMATS = ("nchw", "cl")


def _tensors(layer: Case, precision: str, fmt: str, device: str):
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    xshape = (layer.N, layer.C, layer.H, layer.W)
    wshape = (layer.K, layer.C // layer.groups, *layer.kernel)
    if device == "meta":  # planning only: shapes and strides
        x, w = torch.empty(xshape, device=device, dtype=dtype), torch.empty(wshape, device=device, dtype=dtype)
    else:
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.rand(xshape, device=device, generator=g).to(dtype)
        w = (torch.rand(wshape, device=device, generator=g) - 0.5).to(dtype)
    if fmt == "cl":
        x = x.contiguous(memory_format=torch.channels_last)
        w = w.contiguous(memory_format=torch.channels_last)
    return x, w


def _kwargs(layer: Case) -> dict:
    return dict(stride=layer.stride, padding=layer.padding, groups=layer.groups)


def warm(layers, precisions, formats) -> None:
    """Compile every kernel the table will call, in parallel, before any timing."""
    from kernelgen.functional import spec_for
    from kernelgen.warm import warm_specs

    specs = set()
    for layer in layers:
        for precision in precisions:
            for fmt in formats:
                x, w = _tensors(layer, precision, fmt, "meta")
                spec, _ = spec_for(x, w, None, **_kwargs(layer), device="cuda",
                                   precision=None if precision == "bf16" else precision)
                specs.add(spec)
    results = warm_specs(sorted(specs, key=lambda s: s.to_json()), jobs=int(os.environ.get("KERNELGEN_JOBS", "0"))
                         or os.cpu_count() or 1)
    failed = [r.spec.summary() for r in results if r.status == "failed"]
    print(f"# warmed {len(results)} kernels" + (f"; FAILED: {failed}" if failed else ""), flush=True)


def accuracy_bound(precision: str, x, w, b, kw: dict, ref, torch_err: float) -> tuple[float, str]:
    """(bound, rule) on the relative error against `ref` (float64) by the accuracy rules
    (docs/performance.md): 1e-5 for exact float32 (and float64); for TF32 1.5x the larger of F.conv2d's error and TF32's own, the
    exact convolution of the TF32-rounded operands (cuDNN runs some layers in full float32 even
    with TF32 allowed: depthwise, small ones); for 16-bit 1.5x F.conv2d's."""
    if precision in ("ieee", "fp64"):
        return 1e-5, "<= 1e-5"
    if precision == "tf32":
        tf32_err = rel_err(F.conv2d(tf32_round(x).double(), tf32_round(w).double(),
                                    None if b is None else b.double(), **kw), ref)
        return 1.5 * max(torch_err, tf32_err), "<= 1.5x TF32's"
    return 1.5 * torch_err, "<= 1.5x F.conv2d's"


def run_layer(layer: Case, precision: str, fmt: str) -> dict:
    set_tf32(precision != "ieee")
    x, w = _tensors(layer, precision, fmt, "cuda")
    kw = _kwargs(layer)
    pr = None if precision == "bf16" else precision
    y = kernelgen.conv2d(x, w, precision=pr, **kw)
    spec = kernelgen.functional.spec_for(x, w, None, precision=pr, **kw)[0]
    finite = bool(torch.isfinite(y).all())
    fk, ft = lambda: kernelgen.conv2d(x, w, precision=pr, **kw), lambda: F.conv2d(x, w, **kw)
    kg_ms, torch_ms = paired_ms(fk, ft)
    kg_stream, torch_stream, tries = stream_pair(fk, ft, kg_ms, torch_ms)
    kg_host, torch_host = host_us(fk), host_us(ft)

    n = min(layer.N, 2)
    ref = F.conv2d(x[:n].double(), w.double(), **kw)
    kg_err = rel_err(y[:n], ref)
    torch_err = rel_err(F.conv2d(x[:n], w, **kw), ref)
    bound, rule = accuracy_bound(precision, x[:n], w, None, kw, ref, torch_err)
    layout_ok = y.is_contiguous(memory_format=torch.channels_last if fmt == "cl" else torch.contiguous_format)
    return dict(layer=layer.name, shape=asdict(layer), precision=precision, format=fmt, kernelgen_ms=kg_ms,
                torch_ms=torch_ms, speedup=torch_ms / kg_ms, kernelgen_stream_ms=kg_stream,
                torch_stream_ms=torch_stream, stream_speedup=torch_stream / kg_stream, kernelgen_host_us=kg_host,
                torch_host_us=torch_host, stream_tries=tries, rel_err=kg_err, torch_rel_err=torch_err,
                accuracy_rule=rule, accurate=finite and kg_err <= bound and layout_ok, family=spec.family,
                layout=spec.layout, spec=spec.summary())


def _stream_once(fn, calls: int) -> float:
    torch.cuda.synchronize()
    torch.cuda._sleep(4_000_000)  # ~2 ms at H100 clocks: longer than queueing the calls
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def stream_ms(*fns, calls: int = 20, reps: int = 5) -> list[float]:
    """Each function's median per-call time of `calls` back-to-back calls, queued behind a GPU
    sleep so that the host is never what the GPU waits for. The functions take turns rep by rep,
    so that what disturbs the machine for a while falls on each of them."""
    times = [[] for _ in fns]
    for _ in range(reps):
        for t, fn in zip(times, fns):
            t.append(_stream_once(fn, calls))
    return [statistics.median(t) for t in times]


# A call's stream time is its kernels' time; its latency adds the host's launch work to that. So
# a stream time well over the same call's latency means the measurement was held up (two runs had
# unchanged kernels 2-4x slower in stream time than in latency), and it is taken again.
STREAM_SLACK, STREAM_TRIES = 1.1, 4


def stream_pair(fk, ft, kg_ms: float, torch_ms: float) -> tuple[float, float, int]:
    """(kernelgen, F.conv2d) stream ms and the tries it took: measured again, up to STREAM_TRIES
    times in all, while either exceeds STREAM_SLACK times its latency; each the least over the
    tries (a disturbance only ever adds time)."""
    kg, tt = stream_ms(fk, ft)
    tries = 1
    while tries < STREAM_TRIES and (kg > STREAM_SLACK * kg_ms or tt > STREAM_SLACK * torch_ms):
        k2, t2 = stream_ms(fk, ft)
        kg, tt, tries = min(kg, k2), min(tt, t2), tries + 1
    return kg, tt, tries


def host_us(fn, calls: int = 40, rounds: int = 3) -> float:
    """Host time per call in microseconds, with the GPU kept busy so that calls only queue; the
    least of `rounds` rounds (a garbage collection or a page fault only ever adds time)."""
    best = math.inf
    for _ in range(rounds):
        torch.cuda.synchronize()
        torch.cuda._sleep(40_000_000)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - t0)
        torch.cuda.synchronize()
    return best / calls * 1e6


def retried(row: dict) -> str:
    """The table's note on a stream time that was measured more than once (stream_pair)."""
    tries = row.get("stream_tries", 1)
    return f", {tries} tries" if tries > 1 else ""


def _geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


def summary(rows: list[dict]) -> list[str]:
    lines = ["| precision | format | layers | kernelgen faster | slower | geomean speedup | worst | stream: faster | "
             "stream geomean |",
             "|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r["precision"], r["format"]) for r in rows if "error" not in r},
                  key=lambda k: (PRECISIONS.index(k[0]), FORMATS.index(k[1])))
    for precision, fmt in keys:
        rs = [r for r in rows if r.get("precision") == precision and r.get("format") == fmt and "error" not in r]
        faster = sum(r["speedup"] >= 1.0 for r in rs)
        worst = min(rs, key=lambda r: r["speedup"])
        lines.append(f"| {precision} | {fmt} | {len(rs)} | {faster} | {len(rs) - faster} | "
                     f"{_geomean(r['speedup'] for r in rs):.2f}x | {worst['layer']} {worst['speedup']:.2f}x "
                     f"({worst['family']}) | {sum(r['stream_speedup'] >= 1.0 for r in rs)} | "
                     f"{_geomean(r['stream_speedup'] for r in rs):.2f}x |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default=",".join(LAYERS), help="comma-separated layer names (see --list)")
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    ap.add_argument("--formats", default=",".join(FORMATS), help="nchw, cl (channels_last) or both")
    ap.add_argument("--json", help="write the results here as JSON")
    ap.add_argument("--list", action="store_true", help="print the layers and exit")
    args = ap.parse_args(argv)
    try:
        layers = [LAYERS[name] for name in args.layers.split(",")]
    except KeyError as exc:
        ap.error(f"unknown layer {exc}; --list shows them")
    precisions = args.precisions.split(",")
    formats = args.formats.split(",")
    for value, allowed, what in ((precisions, PRECISIONS, "precision"), (formats, FORMATS, "format")):
        bad = [v for v in value if v not in allowed]
        if bad:
            ap.error(f"unknown {what} {bad}; choose from {list(allowed)}")
    if args.list:
        for layer in layers:
            print(f"{layer.name:22} N={layer.N} {layer.C}->{layer.K} {layer.H}x{layer.W} {layer.kernel[0]}x{layer.kernel[1]}"
                  f" stride {layer.stride} padding {layer.padding} groups {layer.groups}")
        return 0
    if not torch.cuda.is_available():
        print("bench_layers.py needs a CUDA device (--list needs none)", file=sys.stderr)
        return 2
    print(f"# {torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)
    warm(layers, precisions, formats)
    rows = []
    for layer in layers:
        for precision in precisions:
            for fmt in formats:
                try:
                    row = run_layer(layer, precision, fmt)
                except Exception as exc:  # one broken layer must not hide the others' numbers
                    row = dict(layer=layer.name, precision=precision, format=fmt,
                               error=f"{type(exc).__name__}: {exc}"[:500])
                rows.append(row)
                torch.cuda.empty_cache()
    set_tf32(True)
    print("| layer | prec | fmt | kernelgen ms | F.conv2d ms | speedup | stream ms kernelgen / F.conv2d | "
          "host us | rel err (rule) | family |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['layer']} | {r['precision']} | {r['format']} | ERROR {r['error'][:200]} |")
            continue
        print(f"| {r['layer']} | {r['precision']} | {r['format']} | {r['kernelgen_ms']:.3f} | {r['torch_ms']:.3f} | "
              f"{r['speedup']:.2f}x | {r['kernelgen_stream_ms']:.3f} / {r['torch_stream_ms']:.3f} "
              f"({r['stream_speedup']:.2f}x){retried(r)} | {r['kernelgen_host_us']:.0f} / {r['torch_host_us']:.0f} | "
              f"{r['rel_err']:.2e} ({r['accuracy_rule']}: {'ok' if r['accurate'] else 'FAIL'})"
              f" | {r['family']} |")
    print()
    print("\n".join(summary(rows)))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                                   rows=rows), indent=1))
    bad = [r for r in rows if "error" in r or not r["accurate"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
