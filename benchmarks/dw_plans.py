"""What the selector runs for each layer's weight gradient, planned away from a GPU.

    python benchmarks/dw_plans.py [--layers cases,layers] [--cells tf32-nchw,bf16-cl] [--arch sm_90a]

For every (layer, cell) of bench_backward.py's groups it plans the dw gradient on meta tensors
(bench_backward.plan) for a nominal GPU of the target (kernelgen.device.nominal) and prints the
lowered convolution(s) and the family and tiles the selector picks: no GPU, no compile.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_backward  # noqa: E402
from kernelgen.functional import planning_for  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="cases,layers")
    ap.add_argument("--cells", default="tf32-nchw,bf16-cl")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--part", default="dw", choices=("forward", "dx", "dw"))
    args = ap.parse_args(argv)
    counts = Counter()
    with planning_for(args.arch):
        for layer in bench_backward.select(args.layers):
            for cell in args.cells.split(","):
                try:
                    specs = bench_backward.plan(layer, cell, "cuda")[args.part]
                except Exception as exc:  # noqa: BLE001 (the row says why)
                    print(f"{layer.name:28s} {cell:10s} error: {exc}")
                    continue
                for s in specs:
                    counts[s.family] += 1
                    print(f"{layer.name:28s} {cell:10s} {s.summary()}")
    print("# " + ", ".join(f"{f} {n}" for f, n in counts.most_common()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
