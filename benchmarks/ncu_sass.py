"""Summarise Nsight Compute's per-instruction source page (SASS) of one kernel.

    ncu --section SourceCounters --page source --print-source sass --csv ... > k.csv
    python benchmarks/ncu_sass.py k.csv [--top 60]

Prints the executed warp instructions by opcode; the stall samples by execution count (code
run equally often: in a warp-specialised kernel a count is a role, e.g. a consumer warp's
once-a-tile code against a producer warp's), with their main stall reasons; the basic blocks
and the hottest instructions in program order with their counts and sampled stalls: where a
kernel's issue slots and waits go.
"""

from __future__ import annotations

import argparse
import collections
import csv
import sys


def _num(v: str) -> float:
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return 0.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=60)
    args = ap.parse_args(argv)
    lines = [l for l in open(args.csv, errors="replace") if l.startswith('"')]
    rows = list(csv.reader(lines))
    if not rows:
        print("no rows")
        return 1
    # The page opens with the kernel's name; the column names follow on their own row.
    hi = next((i for i, r in enumerate(rows) if any(c.strip() == "Source" for c in r)), None)
    if hi is None:
        print("no header row; first rows:", rows[:3])
        return 1
    head, rows = rows[hi], rows[hi:]
    col = {name: i for i, name in enumerate(head)}
    src = next((i for n, i in col.items() if n.strip() == "Source"), None)
    exe = next((i for n, i in col.items() if n.startswith("Instructions Executed")), None)
    smp = next((i for n, i in col.items() if n.startswith("Warp Stall Sampling (All")), None)
    addr = next((i for n, i in col.items() if n.strip() == "Address"), None)
    if src is None or exe is None:
        print("columns:", head)
        return 1
    body = [r for r in rows[1:] if len(r) > max(src, exe)]
    total = sum(_num(r[exe]) for r in body)
    by_op = collections.Counter()
    for r in body:
        op = r[src].split()[0] if r[src].split() else "?"
        if op.startswith("@"):
            op = r[src].split()[1] if len(r[src].split()) > 1 else op
        by_op[op.split(".")[0]] += _num(r[exe])
    print(f"{len(body)} SASS instructions, {total:.4g} warp instructions executed")
    print("by opcode: " + ", ".join(f"{op} {100 * n / total:.1f}%" for op, n in by_op.most_common(24)))
    if smp is not None:
        # Basic blocks, roughly: runs of consecutive instructions executed equally often. The
        # stall samples show where the warps spend their time.
        blocks, start = [], 0
        for i in range(1, len(body) + 1):
            if i == len(body) or _num(body[i][exe]) != _num(body[start][exe]):
                blocks.append((start, i))
                start = i
        tot_s = sum(_num(r[smp]) for r in body) or 1.0
        reasons = [(n, i) for n, i in col.items() if n.startswith("stall_") and "Not Issued" not in n]
        by_count: dict[str, list] = collections.defaultdict(lambda: [0.0, 0.0, collections.Counter()])
        for r in body:
            c = by_count[f"{_num(r[exe]):.4g}"]
            c[0] += _num(r[exe])
            c[1] += _num(r[smp])
            for n, i in reasons:
                c[2][n] += _num(r[i]) if i < len(r) else 0.0
        print("stall samples by execution count (share, instructions executed, main reasons):")
        for k, (n_exe, n_smp, why) in sorted(by_count.items(), key=lambda kv: -kv[1][1])[:8]:
            top = ", ".join(f"{n[len('stall_'):]} {100 * v / (n_smp or 1):.0f}%" for n, v in why.most_common(3))
            print(f"  executed {k:>10} times: {100 * n_smp / tot_s:5.1f}% of samples, {n_exe:.4g} instructions; {top}")
        print(f"{tot_s:.0f} stall samples; blocks by samples (share, samples, executed x length, first..last):")
        for a, b in sorted(blocks, key=lambda ab: -sum(_num(r[smp]) for r in body[ab[0]:ab[1]]))[:25]:
            bs = sum(_num(r[smp]) for r in body[a:b])
            print(f"  {100 * bs / tot_s:5.1f}% {bs:8.0f} {_num(body[a][exe]):10.4g} x {b - a:4d}  "
                  f"{body[a][src][:60]} .. {body[b - 1][src][:60]}")
    hot = sorted(range(len(body)), key=lambda i: -_num(body[i][exe]))[: args.top]
    for i in sorted(hot):
        r = body[i]
        s = _num(r[smp]) if smp is not None else 0
        a = r[addr] if addr is not None else str(i)
        print(f"{a:>8} {_num(r[exe]):12.4g} {s:8.0f}  {r[src][:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
