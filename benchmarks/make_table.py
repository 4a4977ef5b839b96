"""Measure every family on sampled layers and write the selector's table for this GPU model.

The selector (kernelgen/select.py) ranks the families' candidates for a call by what they measured
on the layers nearest it, on the same GPU model (kernelgen/table.py). This script produces that
data: for each training layer and cell (precision x memory format) it builds every family's own
first choice, checks each against float64 and times the accurate ones in turns with the tuner's
method (kernelgen.tuner.measure: calls queued back to back, median of rounds), beside F.conv2d.
It then fits the cost model's per-family coefficients (kernelgen/costmodel.py) to the same rows
and writes one JSON file with its provenance (GPU, driver, torch, CUDA, commit, date, command).

The training layers are a census sample of another seed than the census's (census.py draws seed 0
by default; this takes 1000 and up), the layers of bench_layers.py, the five KernelBench cases and,
where torchvision is installed, the distinct layers of networks.py's six networks at batch 1 and
32. Never add a census layer by hand.

    python benchmarks/make_table.py [--seed 1000] [--n 200] [--cells tf32-nchw,bf16-cl,...]
        [--budget-s 480] [--no-networks] [--out kernelgen/tables/<gpu>.json] [--merge OLD.json]

`--merge` keeps an earlier table's rows (of the same GPU model) and adds these; a layer measured
again replaces its old row. `--list` prints the training layers and needs no GPU; so do `--check
TABLE` (leave-one-out of the selector over a table's rows) and `--refit TABLE` (its cost model fitted
again to its rows, after a family's cost hooks change).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import bench_cases  # noqa: E402
import bench_layers  # noqa: E402
import census  # noqa: E402
from census import Layer  # noqa: E402

CELLS = census.CELLS
CHUNK = 24  # layers whose kernels are built together before they are timed


def training_layers(seed: int, n: int, networks: bool) -> list[Layer]:
    """The sampled layers, bench_layers', the five cases and (optionally) the networks'."""
    out = list(census.layers(seed=seed, n=n))
    for name, c in bench_layers.LAYERS.items():
        out.append(Layer(f"bench.{name}", c.N, c.C, c.K, c.H, c.W, c.kernel, groups=c.groups, stride=c.stride,
                         padding=c.padding))
    for key, c in bench_cases.CASES.items():
        out.append(Layer(f"case.{key}", c.N, c.C, c.K, c.H, c.W, c.kernel, groups=c.groups, stride=c.stride,
                         padding=c.padding))
    if networks:
        try:
            import networks as nets

            for batch in (1, 32):
                out += nets.distinct_layers(batch=batch)
        except ImportError as exc:
            print(f"# networks skipped: {exc}", flush=True)
    seen, unique = set(), []
    for layer in out:
        key = (layer.N, layer.C, layer.K, layer.H, layer.W, tuple(layer.kernel), layer.stride, layer.padding,
               layer.dilation, layer.groups)
        if key not in seen:
            seen.add(key)
            unique.append(layer)
    return unique


def _layer_json(layer: Layer) -> dict:
    pair = lambda v: list(v) if isinstance(v, (tuple, list)) else [v, v]  # noqa: E731
    return {"name": layer.name, "N": layer.N, "C": layer.C, "K": layer.K, "H": layer.H, "W": layer.W,
            "kernel": list(layer.kernel), "stride": pair(layer.stride), "padding": layer.padding
            if isinstance(layer.padding, str) else pair(layer.padding), "dilation": pair(layer.dilation),
            "groups": layer.groups, "bias": layer.bias}


def _args(layer: Layer, cell: str, device: str) -> dict:
    precision, fmt = cell.split("-")
    x, w, b = census._tensors(layer, precision, fmt, device)
    return dict(input=x, weight=w, bias=b, precision=census._precision(precision), **layer.kwargs())


def measure_chunk(layers: list[Layer], cell: str, jobs: int, device: str = "cuda", top: int = 0) -> list[dict]:
    """Rows for `layers` in `cell`: every family's first choice (or the `top` the selector ranks
    first, where `top` is set) built in parallel, checked, timed."""
    from kernelgen import functional, tuner
    from kernelgen.warm import warm_specs

    bench_cases.set_tf32(not cell.startswith("ieee"))
    planned = []
    for layer in layers:
        try:
            specs, call = functional.candidates_for(**_meta_args(layer, cell, device))
            planned.append((layer, specs[:top] if top else specs))
        except Exception as exc:  # a layer no family serves is a finding, not a crash
            planned.append((layer, exc))
    built = {r.spec: r for r in warm_specs([s for _, ss in planned if isinstance(ss, list) for s in ss], jobs=jobs)}
    rows = []
    for layer, specs in planned:
        row = {"layer": _layer_json(layer), "cell": cell}
        if not isinstance(specs, list):
            rows.append({**row, "error": f"{type(specs).__name__}: {specs}"[:400]})
            continue
        try:
            args = _args(layer, cell, device)
            _, call = functional.candidates_for(**args)
            measured = tuner.measure(args, specs, call, built)
            kw = {k: args[k] for k in ("stride", "padding", "dilation", "groups")}
            torch_us = tuner._stream_us([lambda: F.conv2d(args["input"], args["weight"], args["bias"], **kw)],
                                        cuda=device == "cuda")[0]
            row.update(times_us={s.family: us for s, us, _ in measured},
                       specs={s.family: s.to_json() for s, _, _ in measured},
                       notes={s.family: n for s, _, n in measured if n}, torch_us=torch_us)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:400]
        rows.append(row)
        args = None
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def _meta_args(layer: Layer, cell: str, device: str) -> dict:
    precision, fmt = cell.split("-")
    x, w, b = census._tensors(layer, precision, fmt, "meta")
    return dict(input=x, weight=w, bias=b, precision=census._precision(precision), device=device, **layer.kwargs())


def run_isolated(layers: list[Layer], cell: str, jobs: int, timeout: float, device: str = "cuda",
                 top: int = 0) -> list[dict]:
    """measure_chunk in a process of its own, so that a kernel that faults (a sticky CUDA error)
    costs only its own rows: a chunk whose process dies is measured again a layer a process, and
    a layer that still kills its process is a row with the error."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "layers.json", Path(tmp) / "rows.json"
        spec_path.write_text(json.dumps({"cell": cell, "device": device, "top": top,
                                         "layers": [asdict(l) for l in layers]}))
        cmd = [sys.executable, __file__, "--worker", str(spec_path), str(out_path), "--jobs", str(jobs)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            ok, why = proc.returncode == 0 and out_path.exists(), (proc.stderr or proc.stdout)[-600:]
        except subprocess.TimeoutExpired:  # the budget ran out: nothing to learn by trying again
            return [{"layer": _layer_json(l), "cell": cell, "error": f"timed out after {timeout:.0f} s"}
                    for l in layers]
        if ok:
            return json.loads(out_path.read_text())
    if len(layers) == 1:
        return [{"layer": _layer_json(layers[0]), "cell": cell, "error": f"the measuring process died: {why}"}]
    print(f"# a chunk of {cell} died ({why.strip().splitlines()[-1] if why.strip() else '?'}); "
          "measuring its layers one a process", flush=True)
    return [row for layer in layers for row in run_isolated([layer], cell, jobs, timeout, device, top)]


def _worker(spec_path: str, out_path: str, jobs: int) -> int:
    data = json.loads(Path(spec_path).read_text())
    fields = lambda d: {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}  # noqa: E731
    layers = [Layer(**fields(d)) for d in data["layers"]]
    Path(out_path).write_text(json.dumps(measure_chunk(layers, data["cell"], jobs, data["device"], data["top"])))
    return 0


def fit_model(rows: list[dict], dev=None) -> dict[str, list[float]]:
    """Per family, (launch seconds, mem, math) of kernelgen.costmodel fitted to its measured times by
    least squares on relative error, coefficients kept non-negative (a negative one is dropped and
    the rest fitted again). `dev`: the GPU the rows were measured on (default: this one)."""
    from kernelgen import costmodel
    from kernelgen.device import of
    from kernelgen.spec import ConvSpec, Problem

    if dev is None:
        dev = of(torch.cuda.current_device()) if torch.cuda.is_available() else None
    per_family: dict[str, list] = {}
    for row in rows:
        L = row["layer"]
        for fam, us in (row.get("times_us") or {}).items():
            if us is None:
                continue
            spec = ConvSpec.from_dict(json.loads(row["specs"][fam]))
            P, Q = spec.output_size(L["H"], L["W"])
            prob = Problem(L["N"], L["H"], L["W"], P, Q, device=dev)
            mem = costmodel.estimate(spec, prob, model={fam: (0.0, 1.0, 0.0)})
            mathterm = costmodel.estimate(spec, prob, model={fam: (0.0, 0.0, 1.0)})
            per_family.setdefault(fam, []).append((1.0, mem, mathterm, us * 1e-6))
    model = {}
    for fam, pts in per_family.items():
        if len(pts) < 4:
            continue
        A = torch.tensor([[a, b, c] for a, b, c, _ in pts], dtype=torch.float64)
        y = torch.tensor([t for *_, t in pts], dtype=torch.float64)
        wgt = 1.0 / y  # relative error
        keep = [0, 1, 2]
        coef = torch.zeros(3, dtype=torch.float64)
        while keep:
            sol = torch.linalg.lstsq(A[:, keep] * wgt[:, None], (y * wgt)[:, None]).solution[:, 0]
            if (sol >= 0).all():
                coef[keep] = sol
                break
            keep = [k for k, v in zip(keep, sol.tolist()) if v > 0]
        model[fam] = [float(v) for v in coef]
    return model


def provenance(args, cells) -> dict:
    from kernelgen.device import of

    dev = of(torch.cuda.current_device())
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
    except Exception:
        driver = None
    return {"gpu": dev.name, "arch": dev.arch, "device": dev.to_dict(), "driver": driver, "torch": torch.__version__,
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(), "commit": census._commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "python benchmarks/make_table.py " + " ".join(sys.argv[1:]), "seed": args.seed,
            "n": args.n, "cells": list(cells)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--cells", default=",".join(CELLS))
    ap.add_argument("--budget-s", type=float, default=480.0)
    ap.add_argument("--top", type=int, default=0,
                    help="measure only the selector's first TOP families of each layer (default: every family)")
    ap.add_argument("--no-networks", action="store_true")
    ap.add_argument("--out", help="the table's path (default kernelgen/tables/<gpu>.json)")
    ap.add_argument("--merge", help="an earlier table of this GPU model whose rows to keep")
    ap.add_argument("--only", help="comma-separated name prefixes: measure only those layers (e.g. case.,bench.)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--jobs", type=int, default=int(os.environ.get("KERNELGEN_JOBS", "0")) or os.cpu_count() or 1)
    ap.add_argument("--check", metavar="TABLE", help="leave-one-out of the selector over a table's rows; no GPU")
    ap.add_argument("--refit", metavar="TABLE", help="fit a table's cost model again to its own rows, on the GPU "
                    "facts it was measured with (after a family's cost hooks change); no GPU")
    ap.add_argument("--worker", nargs=2, metavar=("LAYERS", "ROWS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(*args.worker, args.jobs)
    if args.check:
        print("\n".join(check(args.check)))
        return 0
    if args.refit:
        refit(Path(args.refit))
        return 0
    if args.seed < 1000:
        ap.error("--seed: the training sample takes seeds from 1000 (the census's are below)")
    cells = args.cells.split(",")
    bad = [c for c in cells if c not in CELLS]
    if bad:
        ap.error(f"unknown cell(s) {bad}; choose from {list(CELLS)}")
    layers = training_layers(args.seed, args.n, not args.no_networks)
    if args.only:
        layers = [l for l in layers if l.name.startswith(tuple(args.only.split(",")))]
    if args.list:
        for layer in layers:
            print(census.describe(layer))
        print(f"# {len(layers)} layers")
        return 0
    if not torch.cuda.is_available():
        print("make_table.py needs a CUDA device (--list needs none)", file=sys.stderr)
        return 2
    from kernelgen.device import of

    dev = of(torch.cuda.current_device())
    print(f"# {dev.name} ({dev.arch}, {dev.sms} SMs, {dev.dram_bytes_s / 1e12:.2f} TB/s); torch {torch.__version__}",
          flush=True)
    start = time.monotonic()
    out = Path(args.out or ROOT / "kernelgen" / "tables" / f"{dev.key}.json")
    old = []
    if args.merge and Path(args.merge).exists():
        old = json.loads(Path(args.merge).read_text())["rows"]
    rows: list[dict] = []
    # Layers in a seeded shuffled order, each cell in turn a chunk at a time, so a cut run still
    # covers every cell with an unbiased part of the sample; the table is written after each chunk,
    # so a run stopped from outside keeps what it measured.
    order = list(layers)
    random.Random(args.seed).shuffle(order)
    order.sort(key=lambda l: not l.name.startswith("case."))  # the five cases first: the benchmark they guard
    done = 0
    for i in range(0, len(order), CHUNK):
        chunk = order[i:i + CHUNK]
        for cell in cells:
            left = args.budget_s - (time.monotonic() - start)
            if left < 20:
                break
            rows += run_isolated(chunk, cell, args.jobs, timeout=left, top=args.top)
        write_table(out, old, rows, args, cells)
        done += len(chunk)
        print(f"# {done} of {len(order)} layers in {time.monotonic() - start:.0f} s", flush=True)
        if args.budget_s - (time.monotonic() - start) < 20:
            break
    errors = [r for r in rows if "error" in r]
    print(f"# {len(rows)} rows measured ({len(errors)} errors): {out}")
    for r in errors[:10]:
        print(f"#   error {r['layer']['name']} {r['cell']}: {r['error'][:200]}")
    summary(rows)
    return 0


def write_table(out: Path, old: list[dict], rows: list[dict], args, cells) -> None:
    """The table of `old` rows and these (a layer measured again replaces its old row), with the
    cost model fitted to them and the provenance."""
    have = {(json.dumps(r["layer"], sort_keys=True), r["cell"]) for r in rows}
    keep = [r for r in old if (json.dumps(r["layer"], sort_keys=True), r["cell"]) not in have]
    good = [r for r in keep + rows if r.get("times_us")]
    prov = provenance(args, cells)
    if args.merge and Path(args.merge).exists():  # the runs the kept rows came from, this one last
        before = json.loads(Path(args.merge).read_text())["provenance"]
        prov["runs"] = before.get("runs", [{k: before[k] for k in ("commit", "date", "command", "cells") if k in before}])
        prov["runs"].append({k: prov[k] for k in ("commit", "date", "command", "cells")})
    _write(out, {"format": 1, "provenance": prov, "rows": good, "model": fit_model(good)})


def _write(path: Path, table: dict) -> None:
    """`table` as `path`, whole or not at all (written beside it, then renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(table, separators=(",", ":")) + "\n")
    tmp.replace(path)


def refit(path: Path) -> None:
    """The table at `path` with its model fitted again to its rows on the device facts of its
    provenance, the refit recorded there (commit, date)."""
    from kernelgen.device import Device

    table = json.loads(path.read_text())
    dev = Device(**table["provenance"]["device"])
    table["model"] = fit_model(table["rows"], dev)
    table["provenance"]["refit"] = {"commit": census._commit(), "command": f"python benchmarks/make_table.py --refit {path}",
                                    "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    _write(path, table)
    print(f"# {path}: model fitted again to {len(table['rows'])} rows on {dev.name}")


def check(path: str) -> list[str]:
    """Leave-one-out of the selector over a table's own rows: each row in turn left out, its
    measured families ranked by select.rank with the rest of the table, and the pick's time
    compared with the row's fastest (and with F.conv2d's)."""
    from kernelgen import select, table
    from kernelgen.device import Device
    from kernelgen.spec import ConvSpec, Problem

    full = table.read(Path(path))
    raw = [r for r in json.loads(Path(path).read_text())["rows"] if r.get("times_us")]
    device = Device(**full.provenance["device"])
    residuals = full.residuals
    found: dict[str, list] = {}
    real = table.for_device
    try:
        for i, r in enumerate(raw):
            rest = table.Table(full.name, full.provenance, full.rows[:i] + full.rows[i + 1:], full.model)
            rest.__dict__["residuals"] = residuals  # (row i is not among rest.rows)
            table.for_device = lambda d, rest=rest: rest
            times = {f: t for f, t in r["times_us"].items() if t}
            specs = [ConvSpec.from_dict(json.loads(r["specs"][f])) for f in times]
            if len(specs) < 2:
                continue
            L = r["layer"]
            P, Q = specs[0].output_size(L["H"], L["W"])
            pick = select.rank(specs, Problem(L["N"], L["H"], L["W"], P, Q, device=device), r["cell"].endswith("cl"),
                               "tf32" if r["cell"].startswith("tf32") else "ieee")[0].family
            found.setdefault(r["cell"], []).append((times[pick] / min(times.values()), r["torch_us"] / times[pick]))
    finally:
        table.for_device = real
    gm = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs))  # noqa: E731
    return [f"| {cell} | {len(v)} rows | pick over best {gm([a for a, _ in v]):.3f}x | F.conv2d over pick "
            f"{gm([b for _, b in v]):.3f}x, {sum(b >= 0.95 for _, b in v) / len(v):.0%} at 0.95x or better |"
            for cell, v in sorted(found.items())]


def summary(rows: list[dict]) -> None:
    """Per cell: how often each family was fastest, and the families' geometric-mean slowdown."""
    by_cell: dict[str, list] = {}
    for r in rows:
        if r.get("times_us"):
            by_cell.setdefault(r["cell"], []).append(r)
    for cell, rs in sorted(by_cell.items()):
        wins, slow = {}, {}
        for r in rs:
            t = {f: v for f, v in r["times_us"].items() if v}
            if not t:
                continue
            best = min(t, key=t.get)
            wins[best] = wins.get(best, 0) + 1
            for f, v in t.items():
                slow.setdefault(f, []).append(math.log(v / t[best]))
            slow.setdefault("F.conv2d", []).append(math.log(r["torch_us"] / t[best]))
        gm = {f: math.exp(sum(v) / len(v)) for f, v in slow.items()}
        print(f"| {cell} | {len(rs)} layers | wins: " + ", ".join(f"{f} {n}" for f, n in sorted(wins.items(),
              key=lambda e: -e[1])) + " | slowdown vs best: " + ", ".join(f"{f} {g:.2f}x" for f, g in
              sorted(gm.items(), key=lambda e: e[1])) + " |")


if __name__ == "__main__":
    sys.exit(main())
