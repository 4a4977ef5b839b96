"""One case, one precision, one implementation, run twice: a target for Nsight Compute.

    python benchmarks/profile_case.py 63 tf32 kernelgen|torch [--tiles JSON] [--family NAME] [--padding P] [--sass DIR]

The first call compiles (or loads) and warms up; profile the second, e.g. with
benchmarks/ncu_cases.sh. --padding replaces the case's own (63 with --padding 1: 1024-wide output
rows, each on a 32-byte sector, against 63's 1022). Inputs are random, as in bench_cases.py.
--sass DIR writes the machine code (cuobjdump -sass) of every kernelgen extension the process
loaded to DIR/<case>_<precision>.sass.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kernelgen  # noqa: E402
from bench_cases import CASES, set_tf32  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("case", choices=sorted(CASES))
    ap.add_argument("precision", choices=("tf32", "ieee", "bf16"))
    ap.add_argument("who", choices=("kernelgen", "torch"))
    ap.add_argument("--family")
    ap.add_argument("--tiles", type=json.loads)
    ap.add_argument("--padding", type=int, help="instead of the case's own padding")
    ap.add_argument("--sass", type=Path, help="write the loaded kernels' SASS here")
    args = ap.parse_args(argv)
    c = CASES[args.case]
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    set_tf32(args.precision != "ieee")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.rand(c.N, c.C, c.H, c.W, device="cuda", generator=g).to(dtype)
    w = (torch.rand(c.K, c.C // c.groups, *c.kernel, device="cuda", generator=g) - 0.5).to(dtype)
    kw = dict(stride=c.stride, padding=c.padding if args.padding is None else args.padding, groups=c.groups)
    if args.who == "torch":
        fn = lambda: F.conv2d(x, w, **kw)  # noqa: E731
    else:
        extra = {k: v for k, v in (("family", args.family), ("tiles", args.tiles)) if v is not None}
        fn = lambda: kernelgen.conv2d(x, w, **kw, **extra)  # noqa: E731
    for _ in range(2):
        y = fn()
    torch.cuda.synchronize()
    print(f"{args.case} {args.precision} {args.who}: output {tuple(y.shape)} {y.dtype}, finite {bool(torch.isfinite(y).all())}")
    if args.sass:
        args.sass.mkdir(parents=True, exist_ok=True)
        loaded = sorted({line.split()[-1] for line in open("/proc/self/maps")
                         if line.rstrip().endswith(".so") and "/entries/" in line})
        with open(args.sass / f"{args.case}_{args.precision}.sass", "w") as f:
            for so in loaded:
                f.write(f"// {so}\n")
                f.flush()
                subprocess.run(["cuobjdump", "-sass", so], stdout=f, check=False)
        print(f"SASS of {len(loaded)} extension(s) in {args.sass}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
