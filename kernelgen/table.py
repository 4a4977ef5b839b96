"""Measured data for the selector: how each family ran on layers near a call, on this GPU model.

A table (`kernelgen/tables/<gpu>.json`, written by `benchmarks/make_table.py`, never by hand) holds
rows of measured layers: the layer, its cell (precision and memory format), the spec each family
ran it with and the time it took, with the table's provenance (GPU, driver, torch, commit, date,
command) and the cost model's coefficients fitted to those rows (costmodel.py).

For a call, `scores` predicts each candidate's time as the cost model's estimate corrected by how
far that model was off for the candidate's family on the measured layers nearest the call (in the
same cell; distance over the logs of batch, plane, channels a group, groups, taps and stride, a
different kind of layer counting KIND_APART more; the nearer, the heavier, so a layer measured
itself decides). Chosen over ranking the families by their measured slowdowns alone, which did
worse on the same data (leave-one-out over the first H200 table: 1.05-1.06x the time of the
fastest measured family against 1.02-1.04x; docs/selection.md).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:  # pragma: no cover
    from .device import Device
    from .spec import ConvSpec, Problem

FORMAT = 1
TABLE_DIR = Path(__file__).resolve().parent / "tables"
# How many measured layers speak for a call: the nearest of its cell, each with the weight
# weight(d); a layer measured itself (d near 0) outweighs the rest.
NEIGHBOURS = 16
# The cells whose rows stand in for a cell the table has none of, in order.
SIBLINGS = {"bf16-nchw": ("tf32-nchw", "ieee-nchw"), "bf16-cl": ("tf32-cl", "ieee-cl"),
            "tf32-nchw": ("bf16-nchw", "ieee-nchw"), "tf32-cl": ("bf16-cl", "ieee-cl"),
            "ieee-nchw": ("tf32-nchw", "bf16-nchw"), "ieee-cl": ("tf32-cl", "bf16-cl")}


def weight(d: float) -> float:
    return 1.0 / (0.1 + d) ** 2


# Weights of the features in the distance (each a log2 ratio); a different kind of layer is as far
# as KIND_APART.
WEIGHTS = (0.5, 0.75, 1.0, 1.0, 0.75, 1.5, 1.5, 1.0)
KIND_APART = 4.0


def kind(cin: int, cout: int, groups: int, kernel: tuple[int, int]) -> str:
    """The layer's kind: depthwise, grouped, a first layer (8 channels or fewer), 1x1 or kxk."""
    if groups > 1 and groups == cin:
        return "depthwise"
    if groups > 1:
        return "grouped"
    if cin <= 8:
        return "first"
    return "1x1" if tuple(kernel) == (1, 1) else "kxk"


def cell(dtype: str, math_: str, channels_last: bool) -> str:
    """The measured cell a call belongs to, as benchmarks name them: its precision (tf32, ieee, bf16
    for both 16-bit types, f64) and memory format (nchw, cl)."""
    prec = {"float32": "tf32" if math_ == "tf32" else "ieee", "float64": "f64"}.get(dtype, "bf16")
    return f"{prec}-{'cl' if channels_last else 'nchw'}"


def features(N: int, H: int, W: int, cin: int, cout: int, groups: int, kernel, stride, dilation) -> tuple:
    """The point a layer is in the distance's space (module docstring)."""
    lg = lambda v: math.log2(max(v, 1))  # noqa: E731
    (kh, kw), (sh, sw), (dh, dw) = kernel, stride, dilation
    return (lg(N), lg(H * W), lg(cin // groups), lg(cout // groups), lg(groups), lg(kh * kw), lg(sh * sw),
            float(dh * dw > 1))


@dataclass(frozen=True)
class Row:
    cell: str
    kind: str
    point: tuple
    times: Mapping[str, float]  # family -> microseconds of the spec it ran
    specs: Mapping[str, str]  # family -> that spec's JSON
    layer: Mapping  # N, H, W, ...: the problem's sizes


@dataclass(eq=False)
class Table:
    name: str
    provenance: Mapping
    rows: tuple[Row, ...]
    model: Mapping[str, tuple[float, float, float]]  # costmodel's fitted coefficients, by family

    def near(self, cell_: str, kind_: str, point: tuple) -> list[tuple[float, Row]]:
        """The NEIGHBOURS nearest rows of `cell_`, nearest first, with their distances; where the
        table has no row of that cell, of the first cell of the same memory format that it has
        (SIBLINGS: a family's error against the cost model on a layer carries over between
        precisions better than the bare model does)."""
        cells = {row.cell for row in self.rows}
        use = next((c for c in (cell_, *SIBLINGS.get(cell_, ())) if c in cells), None)
        found = []
        for row in self.rows:
            if row.cell != use:
                continue
            d = math.sqrt(sum(w * (a - b) ** 2 for w, a, b in zip(WEIGHTS, point, row.point)))
            found.append((d + (0.0 if row.kind == kind_ else KIND_APART), row))
        found.sort(key=lambda e: e[0])
        return found[:NEIGHBOURS]

    @functools.cached_property
    def families(self) -> frozenset[str]:
        """The families measured on any of the table's rows."""
        return frozenset(f for row in self.rows for f in row.times)

    @functools.cached_property
    def residuals(self) -> dict[int, dict[str, float]]:
        """id(row) -> family -> log(measured / the cost model's estimate)."""
        from . import costmodel
        from .device import Device
        from .spec import ConvSpec, Problem

        device = Device(**self.provenance["device"]) if "device" in self.provenance else None
        out = {}
        for row in self.rows:
            res = {}
            for fam, us in row.times.items():
                try:
                    spec = ConvSpec.from_dict(json.loads(row.specs[fam]))
                    L = row.layer
                    P, Q = spec.output_size(L["H"], L["W"])
                    est = costmodel.estimate(spec, Problem(L["N"], L["H"], L["W"], P, Q, device=device), self.model)
                    res[fam] = math.log(us * 1e-6 / est)
                except (KeyError, ValueError, TypeError):
                    continue
            out[id(row)] = res
        return out


def row_of(entry: Mapping) -> Row:
    """A table row from its JSON entry (benchmarks/make_table.py's format)."""
    layer = entry["layer"]
    kernel, stride, dilation = tuple(layer["kernel"]), tuple(layer["stride"]), tuple(layer["dilation"])
    return Row(cell=entry["cell"], kind=kind(layer["C"], layer["K"], layer["groups"], kernel),
               point=features(layer["N"], layer["H"], layer["W"], layer["C"], layer["K"], layer["groups"], kernel,
                              stride, dilation),
               times={f: float(t) for f, t in entry["times_us"].items() if t is not None},
               specs=dict(entry.get("specs", {})), layer=dict(layer))


def read(path: Path) -> Table:
    data = json.loads(Path(path).read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: table format {data.get('format')!r}, expected {FORMAT}")
    return Table(name=Path(path).stem, provenance=data.get("provenance", {}),
                 rows=tuple(row_of(e) for e in data.get("rows", ())),
                 model={f: tuple(c) for f, c in data.get("model", {}).items()})


@functools.lru_cache(maxsize=None)
def _tables() -> dict[str, Table]:
    return {p.stem: read(p) for p in sorted(TABLE_DIR.glob("*.json"))}


def for_device(device: "Device | None") -> Table | None:
    """The table of `device`'s GPU model; else one of a GPU of the same target (an H200 uses an
    H100's); None where there is none."""
    if device is None:
        return None
    tables = _tables()
    if device.key in tables:
        return tables[device.key]
    same = [t for t in tables.values() if t.provenance.get("arch") == device.arch]
    return same[0] if same else None


def scores(specs: "list[ConvSpec]", problem: "Problem", channels_last: bool, math_: str) -> dict[int, float] | None:
    """id(spec) -> the log of its predicted seconds on this call (module docstring); None where
    this GPU model has no table, or the table has no row of the call's cell. `math_`: the call's
    float32 math ('tf32' or 'ieee')."""
    from . import costmodel
    from .families.base import target

    if not specs or specs[0].device != "cuda":
        return None
    tbl = for_device(target(problem.device))
    if tbl is None:
        return None
    s = specs[0]
    near = tbl.near(cell(s.dtype, math_, channels_last), kind(s.in_channels, s.out_channels, s.groups, s.kernel_size),
                    features(problem.N, problem.H, problem.W, s.in_channels, s.out_channels, s.groups,
                             s.kernel_size, s.stride, s.dilation))
    if not near:
        return None
    corrections = {}
    for spec in specs:
        pts = [(weight(d), tbl.residuals[id(row)][spec.family]) for d, row in near
               if spec.family in tbl.residuals[id(row)]]
        corrections[id(spec)] = (sum(w * r for w, r in pts) / sum(w for w, _ in pts) if pts
                                 else 0.0 if spec.family in tbl.families else None)
    # A family the table never measured on any row (a new one) takes the largest of the measured
    # families' corrections on this call: it is assumed to miss its estimate as badly as the worst
    # of them here, so it is chosen only where it wins by more than the model's misses (no
    # correction at all would favour it exactly where the others' misses are large).
    known = [c for c in corrections.values() if c is not None]
    unmeasured = max(known) if known else 0.0
    return {id(spec): math.log(costmodel.estimate(spec, problem, tbl.model))
            + (unmeasured if corrections[id(spec)] is None else corrections[id(spec)]) for spec in specs}
