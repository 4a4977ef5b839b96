"""Variants of a call side by side with F.conv2d: the A/B bench for dispatch and tile choices.

The calls are warm records (the format `kernelgen warm SPECFILE` reads; kernelgen/warm.py): JSON
objects, one a line or in an array, with `input`, `weight`, `bias`, `stride`, `padding`,
`dilation`, `groups`, `dtype`, `precision`, `memory_format` and, to force a variant, `family`
and `tiles`. Records that differ only in `family` and `tiles` are variants of one call: the
variants of a call are timed in one process, each beside F.conv2d, in turns (all of them once,
then all again, `--rounds` times), so that a drift of the card shows as a drift between rounds
rather than as a difference between variants. The same file warms the cache with `kernelgen warm`.

    python benchmarks/bench_variants.py CALLS [--rounds 2] [--json out.json]
    python benchmarks/bench_variants.py CALLS --dry-run [--arch sm_90a] [--wide-dram]

Each row: the variant's spec (family and tiles as resolved), its stream time (20 calls queued
behind a GPU sleep, as bench_layers.py times, taken again while held up) and latency against
F.conv2d's, and its error against float64 by the accuracy rules of docs/performance.md. A float32 record
without `precision` runs as TF32 (torch's default for convolutions). Inputs are seeded random
normals, weights scaled by their fan-in; a channels_last record makes both input and weight
channels_last, as a channels_last model's are.

`--dry-run` needs no GPU: it prints the spec each record resolves to, for `--arch` (default: this
machine's GPU, else sm_90a) and the DRAM class `--wide-dram` names, and exits 1 if any record
does not resolve.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kernelgen  # noqa: E402
from bench_cases import paired_ms, rel_err, set_tf32  # noqa: E402
from bench_layers import accuracy_bound, stream_pair  # noqa: E402
from kernelgen import functional  # noqa: E402
from kernelgen.spec import canonical_dtype  # noqa: E402
from kernelgen.warm import RecordError, parse_record, read_records, warm_specs  # noqa: E402

VARIANT_FIELDS = ("family", "tiles")


def call_key(record: dict) -> str:
    """What makes two records variants of one call: every field but the variant's own."""
    return json.dumps({k: v for k, v in record.items() if k not in VARIANT_FIELDS}, sort_keys=True)


def variant_label(record: dict) -> str:
    if not record.get("family") and not record.get("tiles"):
        return "default"
    tiles = ",".join(f"{k}={v}" for k, v in sorted((record.get("tiles") or {}).items()))
    return (record.get("family") or "default") + (f"[{tiles}]" if tiles else "")


def load_groups(path: str) -> tuple[list[tuple[str, list[tuple[str, dict]]]], list[str]]:
    """[(call key, [(origin, record), ...]), ...] in the file's order, and the unreadable records'
    messages. Every record is checked as warm checks it (parse_record) by the caller."""
    groups: dict[str, list[tuple[str, dict]]] = {}
    errors = []
    for origin, record in read_records(path):
        if isinstance(record, Exception):
            errors.append(str(record))
        elif not isinstance(record, dict):
            errors.append(f"{origin}: a record is a JSON object, got {type(record).__name__}")
        else:
            groups.setdefault(call_key(record), []).append((origin, record))
    return list(groups.items()), errors


def precision_of(record: dict) -> str:
    """The math the record's call runs: 'tf32' or 'ieee' (float32), else 'bf16', 'fp16', 'fp64'."""
    dtype = canonical_dtype(record.get("dtype", "float32"))
    if dtype == "float32":
        return record.get("precision") or "tf32"
    return {"bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}[dtype]


def tensors(record: dict, seed: int = 0):
    """Seeded CUDA input, weight and bias for a record's call (channels_last where it says)."""
    dtype = getattr(torch, canonical_dtype(record.get("dtype", "float32")))
    g = torch.Generator(device="cuda").manual_seed(seed)
    wshape = record["weight"]
    x = torch.randn(*record["input"], device="cuda", generator=g).to(dtype)
    fan_in = max(1, wshape[1] * wshape[2] * wshape[3])
    w = (torch.randn(*wshape, device="cuda", generator=g) / fan_in ** 0.5).to(dtype)
    b = torch.randn(wshape[0], device="cuda", generator=g).to(dtype) if record.get("bias") else None
    if record.get("memory_format") == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
        w = w.contiguous(memory_format=torch.channels_last)
    return x, w, b


def conv_kwargs(record: dict) -> dict:
    return {k: record[k] for k in ("stride", "padding", "dilation", "groups") if k in record}


def dry_run(groups, arch: str, wide_dram: bool) -> int:
    bad = 0
    print(f"# planned for {arch}{' (wide DRAM)' if wide_dram else ''}")
    with functional.planning_for(arch, wide_dram):
        for _, members in groups:
            print(f"call {members[0][0]}: {call_summary(members[0][1])}")
            for origin, record in members:
                try:
                    spec = parse_record(record, origin)
                    print(f"  {variant_label(record):28s} {spec.summary() if spec else '(an empty batch: no kernel)'}")
                except (RecordError, ValueError) as exc:
                    bad += 1
                    print(f"  {variant_label(record):28s} FAILED: {exc}")
    return 1 if bad else 0


def call_summary(record: dict) -> str:
    kw = ", ".join(f"{k}={v}" for k, v in conv_kwargs(record).items())
    fmt = " channels_last" if record.get("memory_format") == "channels_last" else ""
    prec = f"/{record['precision']}" if record.get("precision") else ""
    return (f"{record.get('dtype', 'float32')}{prec}{fmt} x{tuple(record['input'])} w{tuple(record['weight'])}"
            f"{' bias' if record.get('bias') else ''}{(' ' + kw) if kw else ''}")


def run_variant(record: dict, x, w, b, ref, bound: tuple[float, str]) -> dict:
    prec = precision_of(record)
    kw = conv_kwargs(record)
    opts = dict(family=record.get("family"), tiles=record.get("tiles"),
                precision=prec if prec in ("tf32", "ieee") else None)
    spec = functional.spec_for(x, w, b, **kw, **opts)[0]
    fk, ft = (lambda: kernelgen.conv2d(x, w, b, **kw, **opts)), (lambda: F.conv2d(x, w, b, **kw))
    y = fk()
    err = rel_err(y, ref)
    kg_ms, torch_ms = paired_ms(fk, ft, rounds=2, reps=10)
    kg_stream, torch_stream, tries = stream_pair(fk, ft, kg_ms, torch_ms)
    return dict(variant=variant_label(record), spec=spec.summary(), family=spec.family, tiles=dict(spec.tiles),
                kernelgen_stream_ms=kg_stream, torch_stream_ms=torch_stream,
                stream_speedup=torch_stream / kg_stream, stream_tries=tries, kernelgen_ms=kg_ms, torch_ms=torch_ms,
                speedup=torch_ms / kg_ms, rel_err=err, accuracy_rule=bound[1],
                accurate=bool(torch.isfinite(y).all()) and err <= bound[0])


def measure(groups, rounds: int) -> list[dict]:
    specs = set()
    for _, members in groups:
        for origin, record in members:
            spec = parse_record(record, origin)
            if spec is not None:
                specs.add(spec)
    results = warm_specs(sorted(specs, key=lambda s: s.to_json()),
                         jobs=int(os.environ.get("KERNELGEN_JOBS", "0")) or os.cpu_count() or 1)
    failed = [r.spec.summary() for r in results if r.status == "failed"]
    print(f"# warmed {len(results)} kernels" + (f"; FAILED: {failed}" if failed else ""), flush=True)
    rows = []
    print("| call | round | variant | spec | stream us kernelgen / F.conv2d | speedup | latency ms kernelgen / "
          "F.conv2d | rel err (rule) |")
    print("|---|---|---|---|---|---|---|---|")
    for _, members in groups:
        first = members[0][1]
        set_tf32(precision_of(first) != "ieee")
        x, w, b = tensors(first)
        kw = conv_kwargs(first)
        ref = F.conv2d(x.double(), w.double(), None if b is None else b.double(), **kw)
        torch_err = rel_err(F.conv2d(x, w, b, **kw), ref)
        bound = accuracy_bound(precision_of(first), x, w, b, kw, ref, torch_err)  # once a call, not a variant
        for r in range(rounds):
            for origin, record in members:
                try:
                    row = run_variant(record, x, w, b, ref, bound)
                except Exception as exc:  # a variant that fails is a row, not the end of the table
                    row = dict(variant=variant_label(record), error=f"{type(exc).__name__}: {exc}")
                row.update(call=call_summary(record), origin=origin, round=r + 1, torch_rel_err=torch_err)
                rows.append(row)
                print(format_row(row), flush=True)
    return rows


def format_row(row: dict) -> str:
    if "error" in row:
        return f"| {row['call']} | {row['round']} | {row['variant']} | FAILED: {row['error'][:200]} | | | | |"
    ok = "ok" if row["accurate"] else "FAIL"
    return (f"| {row['call']} | {row['round']} | {row['variant']} | {row['spec']} | "
            f"{row['kernelgen_stream_ms'] * 1e3:.1f} / {row['torch_stream_ms'] * 1e3:.1f} | "
            f"{row['stream_speedup']:.2f}x | {row['kernelgen_ms']:.3f} / {row['torch_ms']:.3f} | "
            f"{row['rel_err']:.2e} ({row['accuracy_rule']}: {ok}) |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("calls", help="warm records: a JSON file (object or array) or JSON Lines")
    ap.add_argument("--rounds", type=int, default=1, help="times each call's variants are timed in turn")
    ap.add_argument("--json", help="write the rows here as JSON")
    ap.add_argument("--dry-run", action="store_true", help="print each record's spec; no GPU needed")
    ap.add_argument("--arch", help="with --dry-run: the target to plan for (default: this GPU's, else sm_90a)")
    ap.add_argument("--wide-dram", action="store_true", help="with --dry-run: plan the wide-DRAM class")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    try:
        groups, errors = load_groups(args.calls)
    except RecordError as exc:
        print(f"bench_variants.py: {exc}", file=sys.stderr)
        return 2
    for e in errors:
        print(f"bench_variants.py: {e}", file=sys.stderr)
    if args.dry_run:
        arch = args.arch or (functional._cuda_target(torch.cuda.current_device())[0]
                             if torch.cuda.is_available() else "sm_90a")
        return max(dry_run(groups, arch, args.wide_dram), 1 if errors else 0)
    if not torch.cuda.is_available():
        print("bench_variants.py needs a CUDA device (--dry-run does not)", file=sys.stderr)
        return 2
    print(f"# {torch.cuda.get_device_name()}; torch {torch.__version__}")
    rows = measure(groups, args.rounds)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                                   rows=rows), indent=1))
    bad = [r for r in rows if "error" in r or not r["accurate"]]
    return 1 if bad or errors else 0


if __name__ == "__main__":
    sys.exit(main())
