"""Which kernel runs a call: the one selector.

Families say what they *can* run (`Family.candidates`, every launch precondition checked against
the GPU). This module decides what *should* run, in this order:

1. a choice measured on this GPU at the call's sizes (`kernelgen.tune`), kept in the call's plan
   record (plans.py), which functional.py serves before anything here is asked;
2. without one, the measured data of this GPU model (`kernelgen/tables/`, written by
   `benchmarks/make_table.py` from timings of every family on sampled layers, with provenance):
   each candidate's cost-model estimate, corrected by how far the model was off for its family
   on the measured layers nearest this one (table.py);
3. where no measured layer is near, the cost model alone (costmodel.py): bytes and FLOPs against
   the GPU's bandwidth and math rate, with per-family coefficients fitted from the same table.

Ties go to the family met first in `FAMILY_ORDER` (a deterministic order, not a ranking). The
evidence behind the families and the tables is in benchmarks/results/ and docs/selection.md.

Sampled 1x1 layers: an NCHW 1x1 layer of one group, with a stride and no padding, reads only
every sh-th row and sw-th column, so it is computed as the stride-1 layer of the view
input[..., ::sh, ::sw] (`sampled_1x1`; measured: docs/selection.md); a forced family runs the
call as it is.

Forcing: `family=` (and `tiles=`) pick that family's first candidate that has those tiles, or fail
with its reason; `tiles=` alone narrows the choice to the families that have every tile named.
"""

from __future__ import annotations

from typing import Any, Mapping

from .errors import ConvArgumentError, Unsupported
from .families import all_families, get_family
from .families.base import target
from .spec import ConvSpec, Problem

# Every family, in a fixed order that only breaks ties: the same inputs always give the same choice.
FAMILY_ORDER = ("depthwise_planes", "depthwise", "depthwise_nhwc", "grouped_nhwc", "grouped_mma", "stem_nhwc",
                "pointwise_tma", "nhwc_tma", "nhwc", "wgmma", "pointwise_tile", "pointwise", "igemm", "wgrad", "gemv", "direct",
                "cpu_direct")


def _names(device: str) -> list[str]:
    fams = all_families()
    return [n for n in FAMILY_ORDER if n in fams and fams[n].device == device]


def layout_for(family_layouts: tuple[str, ...], channels_last: bool) -> str | None:
    """The layout a family is handed for a call whose output is channels_last or not: the
    output's own, or 'any' (strided); None where the family takes neither."""
    want = "nhwc" if channels_last else "nchw"
    if want in family_layouts:
        return want
    if "any" in family_layouts:
        return "any"
    return None


def family_math(fam, dtype: str, math: str) -> str:
    """The math a family runs a call in: the call's for float32 on a TF32-capable family, else exact."""
    return math if (fam.tf32 and dtype == "float32") else "ieee"


def candidates(params: Mapping[str, Any], device: str, problem: Problem, channels_last: bool, math: str,
               family: str | None = None, tiles: Mapping[str, int] | None = None,
               every: bool = False) -> tuple[list[ConvSpec], list[str]]:
    """(specs, reasons): what the families can run for a call, and why the others cannot.

    `params`: the call's spec fields (checks.spec_params). With `every`, each family's whole list
    of candidates (Family.candidates), else its own first choice only. `family`/`tiles` narrow
    the families as forcing does (module docstring).
    """
    names = [family] if family is not None else _names(device)
    out, reasons = [], []
    for name in names:
        fam = get_family(name)
        missing = sorted(set(tiles or ()) - set(fam.tiles))
        if missing:
            reasons.append(f"{name}: has no tile parameter(s) {missing}")
            continue
        layout = layout_for(fam.layouts, channels_last)
        if layout is None:
            reasons.append(f"{name}: takes layouts {list(fam.layouts)}")
            continue
        base = ConvSpec(**params, device=device, layout=layout, math=family_math(fam, params["dtype"], math),
                        family=name)
        try:
            fam.check_target(problem.device)
            found = fam.candidates(base, problem, fixed=tiles) if every else [_first(fam, base, problem, tiles)]
            if not found:
                raise Unsupported(_first_reason(fam, base, problem, tiles))
        except Unsupported as exc:
            text = str(exc)
            reasons.append(text if text.startswith(f"{name}:") or text.startswith(f"{name} ") else f"{name}: {text}")
            continue
        out.extend(found)
    return out, reasons


def _first(fam, base: ConvSpec, problem: Problem, tiles: Mapping[str, int] | None) -> ConvSpec:
    """`fam`'s own first choice for the call `base` describes, `tiles` forced over it. Where its
    check refuses that on the problem's GPU (its tile rules sized for another) and no tiles are
    forced, its first candidate that fits. Raises Unsupported, with the first choice's reason,
    where none does (forced tiles: where the family's own choice around them does not)."""
    device = target(problem.device)
    try:
        chosen = dict(fam.default_tiles(base, problem, fixed=tiles))
        chosen.update(tiles or {})
        spec = base.replace(tiles=tuple(chosen.items()))
        fam.check(spec, device)
        return spec
    except Unsupported:
        found = [] if tiles else fam.candidates(base, problem)
        if found:
            return found[0]
        raise


def _first_reason(fam, base, problem, tiles) -> str:
    try:
        _first(fam, base, problem, tiles)
    except Unsupported as exc:
        return str(exc)
    return "no configuration fits"


def rank(specs: list[ConvSpec], problem: Problem, channels_last: bool, math: str) -> list[ConvSpec]:
    """`specs` (candidates of one call), the one that should run first: by the measured table of
    the problem's GPU where it has layers near this one, else by the cost model; ties in
    FAMILY_ORDER, then each family's own order."""
    if len(specs) <= 1:
        return list(specs)
    from . import costmodel, table

    order = {name: i for i, name in enumerate(FAMILY_ORDER)}
    position = {id(s): i for i, s in enumerate(specs)}
    scores = table.scores(specs, problem, channels_last, math)
    if scores is None:
        scores = {id(s): costmodel.estimate(s, problem) for s in specs}
    return sorted(specs, key=lambda s: (scores.get(id(s), float("inf")), order.get(s.family, len(order)),
                                        position[id(s)]))


def ranked(params: Mapping[str, Any], device: str, problem: Problem, channels_last: bool, math: str,
           family: str | None = None, tiles: Mapping[str, int] | None = None, every: bool = False) -> list[ConvSpec]:
    """A call's candidates, the one that should run first: the families' first choices by `rank`,
    then (with `every`) each family's other configurations, its families in that order. `params`
    are the call's spec fields (checks.spec_params). Raises ConvArgumentError where no family
    serves the call (or the forced one cannot), naming each family's reason."""
    firsts, reasons = candidates(params, device, problem, channels_last, math, family=family, tiles=tiles)
    if not firsts:
        if family is not None:
            raise ConvArgumentError(f"family {family!r} cannot serve this convolution: {'; '.join(reasons)}")
        raise ConvArgumentError(f"no kernel family serves this convolution on {device}: {'; '.join(reasons)}")
    order = rank(firsts, problem, channels_last, math)
    if not every:
        return order
    more, _ = candidates(params, device, problem, channels_last, math, family=family, tiles=tiles, every=True)
    place = {spec.family: i for i, spec in enumerate(order)}
    return order + sorted((s for s in more if s not in order), key=lambda s: place.get(s.family, len(place)))


def choose(params: Mapping[str, Any], device: str, problem: Problem, channels_last: bool, math: str,
           family: str | None = None, tiles: Mapping[str, int] | None = None) -> ConvSpec:
    """The spec to compile for a call, untuned: the first of `ranked`."""
    return ranked(params, device, problem, channels_last, math, family=family, tiles=tiles)[0]


def sampled_1x1(spec: ConvSpec, device: str, channels_last: bool) -> tuple[int, int] | None:
    """(sh, sw) where the call is computed as the stride-1 layer of input[..., ::sh, ::sw]
    (module docstring): CUDA, NCHW, one group, a 1x1 kernel, no padding and a stride other than 1.
    `spec`: the call's validated parameters. Else None."""
    if (device != "cuda" or channels_last or spec.groups != 1 or spec.kernel_size != (1, 1)
            or any(spec.padding) or spec.stride == (1, 1)):
        return None
    return spec.stride
