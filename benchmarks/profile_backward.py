"""Where a layer's backward time goes: host time, CUDA-graph time and the kernels, beside cuDNN's.

    python benchmarks/profile_backward.py LAYERS [--cells tf32-nchw,bf16-cl] [--calls 200] [--top 10]

LAYERS: bench_backward.py's layer and group names (`--list` there). For each layer and cell, on
bench_backward.py's tensors (seeded random x, w, grad_out), for kernelgen and for F.conv2d (cuDNN):

- host ms: `--calls` eager `torch.autograd.grad` calls queued back to back, timed by the host clock
  up to the last queued call (the host's share), then to the end of the GPU's work (drain). Where
  host time is about the drained time, the eager backward is bound by its host.
- graph ms: the same backward captured in a CUDA graph and replayed (medians of event-timed rounds):
  the GPU's time alone, no host.
- kernels: torch.profiler over five calls, the CUDA kernels by name, milliseconds and launches per
  call (kernelgen's `kernelgen::conv2d[family]` ranges are left out: they wrap kernels listed).

One process, both libraries side by side, the card named in the first line. Results belong in
benchmarks/results/ with the card, date and commit (h200_backward_profile.md is such a record).
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_backward  # noqa: E402
from kernelgen import config  # noqa: E402
from bench_cases import rounds_ms, set_tf32  # noqa: E402
from bench_networks import graphed  # noqa: E402


def host_ms(fn, calls: int) -> tuple[float, float]:
    """(host, drained): ms per call of `calls` queued calls, to the last queued and to the GPU's end."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host / calls * 1e3, (time.perf_counter() - start) / calls * 1e3


def graph_ms(fn) -> float:
    """ms per replay of `fn` captured in a CUDA graph (bench_networks.graphed's capture)."""
    return rounds_ms(graphed(fn), rounds=3, reps=20, warmup=5)[0]


def kernels(fn, calls: int = 5) -> list[tuple[str, float, float]]:
    """[(kernel name, ms a call, launches a call)], the costliest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    found: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and not event.name.startswith("kernelgen::"):
            found[event.name][0] += event.device_time / 1e3 / calls
            found[event.name][1] += 1 / calls
    return sorted(((name, ms, n) for name, (ms, n) in found.items()), key=lambda row: -row[1])


def profile_layer(layer, cell: str, calls: int, top: int) -> None:
    precision, fmt = cell.split("-")
    set_tf32(precision != "ieee")
    x, w, b, gy = bench_backward.tensors(layer, precision, fmt, "cuda")
    leaves = tuple(t for t in (x, w, b) if t is not None)
    for who, forward in zip(("kernelgen", "cuDNN"), bench_backward._forward(layer, precision, x, w, b)):
        y = forward()

        def backward(y=y):
            return torch.autograd.grad(y, leaves, gy, retain_graph=True)

        host, drained = host_ms(backward, calls)
        try:
            graph = f"{graph_ms(backward):.3f}"
        except RuntimeError as exc:  # (a backward that cannot be captured says so, and the rest goes on)
            graph = f"not capturable: {str(exc).splitlines()[0][:80]}"
        rows = kernels(backward)
        print(f"{layer.name} {cell} {who}: host {host:.3f} ms/call, drained {drained:.3f}, graph {graph}, "
              f"kernels {sum(ms for _, ms, _ in rows):.3f} ms in {sum(n for _, _, n in rows):.0f} launches")
        for name, ms, n in rows[:top]:
            print(f"    {ms:8.4f} ms  x{n:<3.0f} {name[:110]}")
        sys.stdout.flush()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("layers")
    ap.add_argument("--cells", default="tf32-nchw,bf16-cl")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--top", type=int, default=10)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_backward.py needs a CUDA GPU", file=sys.stderr)
        return 2
    layers, cells = bench_backward.select(args.layers), args.cells.split(",")
    print(f"# {torch.cuda.get_device_name()}; torch {torch.__version__}; {len(layers)} layers, cells {cells}")
    bench_backward.warm(layers, cells, "cuda", config.jobs())  # (KERNELGEN_JOBS workers)
    for layer in layers:
        for cell in cells:
            profile_layer(layer, cell, args.calls, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
