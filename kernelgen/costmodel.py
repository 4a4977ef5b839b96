"""The selector's estimate of a kernel's time where no measured layer is near: bytes and FLOPs.

    time = launch + mem * bytes / bandwidth + math * flops / rate * waves

`bytes`: what the family moves through DRAM (Family.traffic: input, weights and output once, and
the passes it adds, such as an NCHW input's transpose); `flops`: the multiply-adds it computes,
its tiles' padding included (Family.work), three times over for strict float32 on tensor cores
(3xTF32); `rate` and `bandwidth`: the GPU's
(kernelgen.device); `waves`: the last wave of tiles over the SMs rounded up. The coefficients
(launch seconds, mem, math) are fitted per family from measurements (a table's `model`, written by
benchmarks/make_table.py); without one a family takes its unit's prior below.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .families import get_family
from .families.base import target

if TYPE_CHECKING:  # pragma: no cover
    from .spec import ConvSpec, Problem

# Priors (launch seconds, mem, math) by the unit a family computes on: a kernel moves its bytes at
# best at the copy's rate and computes at a fraction of the unit's peak (as measured on Hopper:
# mma.sync near 60%, wgmma beyond; scalar loops far under the FMA peak).
PRIORS = {"wgmma": (4e-6, 1.2, 1.4), "mma": (4e-6, 1.3, 1.8), "fma": (3e-6, 1.2, 2.0), "direct": (3e-6, 2.0, 8.0)}
# A family's own priors, by its cost class, where its work counts issue slots besides the products
# (so its math coefficient is an issue efficiency, not a fraction of the unit's peak). Derived from
# the kernel's structure, not measured (docs/selection.md, "wgrad's cost, derived"): two launches,
# element-wise loads of whole lines, two thirds of the issue rate.
FAMILY_PRIORS = {("wgrad", "mma"): (7e-6, 1.3, 1.5), ("wgrad", "fma"): (7e-6, 1.3, 1.5)}
# Packing a transient weight (Problem.transient: a gradient's operand, packed on every call by a
# family that packs): a launch, and the weight's bytes at a twelfth of the copy rate. Measured on an
# H200 (benchmarks/results/h200_backward_profile.md): the repack kernels moved 4.4 MB of weights in
# 18.5 us and 13.3 MB in 46.6 us, about 0.3 TB/s.
PACK_LAUNCH_S, PACK_SLOWDOWN = 3e-6, 12.0


def estimate(spec: "ConvSpec", problem: "Problem", model=None) -> float:
    """Seconds `spec` should take on `problem` (its GPU's facts, or a nominal H100's)."""
    from . import table

    device = target(problem.device)
    fam = get_family(spec.family)
    unit = fam.unit(spec)
    tbl = table.for_device(device) if model is None else None
    cls = fam.cost_class(spec)
    prior = FAMILY_PRIORS.get((spec.family, cls), PRIORS[cls])
    launch, mem, math_ = (model or (tbl.model if tbl else {})).get(spec.family, prior)
    if unit == "fma":
        rate = device.peak_flops("fma")
    else:
        rate = device.peak_flops("f16" if spec.dtype in ("float16", "bfloat16") else "tf32")
        if spec.dtype == "float32" and spec.math == "ieee":
            rate /= 3.0  # 3xTF32: three products a multiply-add
    if spec.dtype == "float64":
        rate = device.peak_flops("fma") / 32.0
    tiles = fam.tiles_of(spec, problem)
    slots = device.sms * 2
    waves = -(-tiles // slots) * slots / tiles if tiles else 1.0
    pack = pack_seconds(spec, problem, device) if problem.transient else 0.0
    return (launch + mem * fam.traffic(spec, problem) / device.dram_bytes_s
            + math_ * fam.work(spec, problem) / rate * waves + pack)


def pack_seconds(spec: "ConvSpec", problem: "Problem", device) -> float:
    """What packing the weight costs a call that packs it every time (PACK_* above); 0 for a
    configuration that reads its weights as they lie (PACKED_BYTES 0)."""
    from .spec import ELEMENT_BYTES

    if not spec.template_context().get("PACKED_BYTES"):
        return 0.0
    kh, kw = spec.kernel_size
    weight = spec.out_channels * spec.cin_per_group * kh * kw * ELEMENT_BYTES[spec.dtype]
    return PACK_LAUNCH_S + PACK_SLOWDOWN * weight / device.dram_bytes_s
