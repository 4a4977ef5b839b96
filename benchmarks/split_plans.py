"""Which census layers change their plan because of pointwise_tma's split reductions, on a nominal GPU.

    python benchmarks/split_plans.py [--arch sm_90a] [--wide] [--seed 0] [--n 320] [--networks]

Plans every layer of census.py's sample (`--networks`: and networks.py's, which needs torchvision)
in the cells pointwise_tma serves (TF32 and bf16 NCHW) with the selector, as kernelgen.conv2d would
untuned, twice: as it is, and with pointwise_tma's split_choice held at 1. Prints each layer whose
plan differs, both plans, and the count. Needs no GPU: the families size for kernelgen.device.nominal.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import census  # noqa: E402
from kernelgen.families import pointwise_tma  # noqa: E402
from kernelgen.functional import planning_for, spec_for  # noqa: E402

CELLS = ("tf32-nchw", "bf16-nchw")


def plan(layer: census.Layer, cell: str) -> str:
    """The summary of the spec the selector plans for `layer` in `cell`, or why none."""
    precision, fmt = cell.split("-")
    try:
        x, w, b = census._tensors(layer, precision, fmt, "meta")
        spec, _ = spec_for(x, w, b, **layer.kwargs(), device="cuda", precision=census._precision(precision))
    except Exception as exc:  # conv2d would raise the same
        return census._error(exc)
    return "nothing to compute" if spec is None else spec.summary()


def changed(sample: list[census.Layer], arch: str, wide: bool) -> list[tuple[str, str, str, str]]:
    """(layer, cell, plan without splits, plan with them) for each plan the splits change."""
    out = []
    with planning_for(arch, wide_dram=wide):
        for layer in sample:
            for cell in CELLS:
                now = plan(layer, cell)
                if "pointwise_tma" not in now:
                    continue  # (holding split_choice at 1 can only change pointwise_tma's plans)
                with mock.patch.object(pointwise_tma, "split_choice", lambda *a, **k: 1):
                    before = plan(layer, cell)
                if before != now:
                    out.append((census.describe(layer), cell, before, now))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--wide", action="store_true", help="the target's larger-memory part (an H200 for sm_90a)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n", type=int, default=320)
    ap.add_argument("--networks", action="store_true", help="networks.py's layers at batch 1 and 32 too")
    args = ap.parse_args(argv)
    sample = census.layers(args.seed, args.n) + (census.network_sample() if args.networks else [])
    rows = changed(sample, args.arch, args.wide)
    for layer, cell, before, now in rows:
        print(f"{layer}  [{cell}]\n    without splits: {before}\n    with splits:    {now}")
    print(f"{len(rows)} plans of {len(sample)} layers x {len(CELLS)} cells change ({args.arch}"
          f"{', wide' if args.wide else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
