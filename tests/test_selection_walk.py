"""CPU-tier walk of the selector as a whole: every call F.conv2d accepts gets a spec.

Which family the selector picks is measured data (kernelgen/tables/) or the cost model, so
nothing here asserts it. The walk goes over many shapes of grouped, dense and depthwise layers,
in every dtype, precision and layout, on the nominal GPUs of several targets (an H100, an H200,
an A100, an L40S with 99 KB of shared memory a block), and asks only that `select.choose`
answers with a spec its family accepts on that GPU, and that a family which can run a call
there at all offers its own first choice for it (also over a walk of wide layers that press on
shared memory and registers). A family's default tiles that its own table refuses (grouped_mma
once chose 5 groups a block for bf16 groups of 12 channels, and every such NCHW call raised), or
that exceed a smaller GPU's shared memory while smaller tiles fit, fail here rather than in a
user's call.
"""

from __future__ import annotations

import random

import pytest

from kernelgen import select
from kernelgen.device import nominal
from kernelgen.families import get_family
from kernelgen.errors import ConvArgumentError
from kernelgen.spec import ConvSpec, Problem


def _calls(seed: int, n: int):
    """(params, (N, H, W), channels_last, math) of `n` calls of the layers most networks have."""
    rng = random.Random(seed)
    for _ in range(n):
        groups = rng.choice([1, 1, 2, 3, 4, 8, 32])
        cin_g = rng.choice(list(range(1, 21)) + [24, 32, 40, 48, 64])
        cout_g = rng.choice([1, 2, 4, 8, 12, 16, 24, 32])
        if rng.random() < 0.1:  # depthwise with a multiplier
            groups, cin_g = rng.choice([8, 32, 96]), 1
        k = rng.choice([(1, 1), (3, 3), (3, 3), (5, 5), (7, 7), (3, 1), (1, 5)])
        stride = rng.choice([1, 1, 2])
        hw = rng.choice([(7, 7), (14, 14), (20, 20), (28, 28), (56, 56), (9, 130)])
        dtype = rng.choice(["float32", "float32", "bfloat16", "float16"])
        math = rng.choice(["tf32", "ieee"]) if dtype == "float32" else "ieee"
        yield dict(in_channels=groups * cin_g, out_channels=groups * cout_g, kernel_size=k, stride=stride,
                   padding=(k[0] // 2, k[1] // 2), dilation=1, groups=groups, dtype=dtype,
                   bias=rng.random() < 0.5), (8,) + hw, rng.random() < 0.5, math


def _wide_calls(seed: int, n: int):
    """As _calls, of layers that press on a GPU's shared memory and registers: hundreds of channels
    a group, kernels up to 9x9, dilations, planes up to 224 x 224 and rows of 1000."""
    rng = random.Random(seed)
    while n:
        groups = rng.choice([1, 1, 1, 2, 4, 32])
        cin_g = rng.choice([3, 4, 8, 16, 32, 64, 96, 128, 256, 512])
        cout_g = rng.choice([8, 16, 32, 64, 128, 256, 512])
        if rng.random() < 0.15:  # depthwise, with a multiplier or not
            groups, cin_g, cout_g = rng.choice([32, 96, 384, 960]), 1, rng.choice([1, 2])
        k = rng.choice([(1, 1), (3, 3), (5, 5), (7, 7), (9, 9), (3, 1), (1, 7)])
        stride, dilation = rng.choice([1, 1, 2, 3]), rng.choice([1, 1, 1, 2, 4])
        hw = rng.choice([(7, 7), (14, 14), (28, 28), (56, 56), (112, 112), (224, 224), (64, 512), (1, 1000)])
        dtype = rng.choice(["float32", "float32", "bfloat16", "float16"])
        math = rng.choice(["tf32", "ieee"]) if dtype == "float32" else "ieee"
        params = dict(in_channels=groups * cin_g, out_channels=groups * cout_g, kernel_size=k, stride=stride,
                      padding=(k[0] // 2 * dilation, k[1] // 2 * dilation), dilation=dilation, groups=groups,
                      dtype=dtype, bias=rng.random() < 0.5)
        N, channels_last = rng.choice([1, 8, 32]), rng.random() < 0.5
        if min(ConvSpec(**params).output_size(*hw)) > 0:
            n -= 1
            yield params, (N,) + hw, channels_last, math


# (target, its larger-memory part): a nominal H100, H200, A100 and L40S (kernelgen.device.nominal)
GPUS = [("sm_90a", False), ("sm_90a", True), ("sm_80", False), ("sm_89", False)]
GPU_IDS = ["h100", "h200", "a100", "l40s"]


def _problem(params, shape, device) -> Problem:
    N, H, W = shape
    P, Q = ConvSpec(**params).output_size(H, W)
    return Problem(N=N, H=H, W=W, P=P, Q=Q, device=device)


@pytest.mark.parametrize("arch,wide", GPUS, ids=GPU_IDS)
def test_every_call_gets_a_spec_its_family_accepts(arch, wide):
    device = nominal(arch, wide_dram=wide)
    failures = []
    for params, hw, channels_last, math in _calls(1234, 600):
        try:
            spec = select.choose(params, "cuda", _problem(params, hw, device), channels_last, math)
            get_family(spec.family).check(spec, device)
        except Exception as exc:  # collected, so that one run names every failing shape
            failures.append(f"{params} {hw} channels_last={channels_last} {math}: {type(exc).__name__}: {exc}")
    assert not failures, f"{len(failures)} calls failed, the first ones:\n" + "\n".join(failures[:8])


@pytest.mark.parametrize("walk", ["common", "wide"])
@pytest.mark.parametrize("arch,wide", GPUS, ids=GPU_IDS)
def test_a_family_that_can_run_a_call_offers_its_first_choice(arch, wide, walk):
    """Where a family has any configuration that compiles and launches for a call on a GPU, its
    own first choice is one (default tiles sized for another GPU's shared memory, registers or
    SMs are refused there, and the untuned selector, which ranks first choices, silently passes
    the family over), it comes first among its candidates, and every candidate passes the
    family's check on that GPU."""
    device = nominal(arch, wide_dram=wide)
    failures = []
    for params, hw, channels_last, math in (_calls(1234, 300) if walk == "common" else _wide_calls(7, 300)):
        problem = _problem(params, hw, device)
        where = f"{params} {hw} channels_last={channels_last} {math}"
        firsts, reasons = select.candidates(params, "cuda", problem, channels_last, math)
        every, _ = select.candidates(params, "cuda", problem, channels_last, math, every=True)
        first = {s.family: s for s in firsts}
        seen = set()
        for spec in every:
            fam = get_family(spec.family)
            if spec.family not in seen:
                seen.add(spec.family)
                if first.get(spec.family) != spec:
                    why = [r for r in reasons if r.startswith(f"{spec.family}:")]
                    failures.append(f"{where}: {why[0] if why else spec.family + ': its first choice is not first'}"
                                    f" (yet {dict(spec.tiles)} fits)")
            try:
                fam.check(spec, device)
            except Exception as exc:
                failures.append(f"{where}: {spec.family} {dict(spec.tiles)}: {type(exc).__name__}: {exc}")
        if set(first) - seen:
            failures.append(f"{where}: first choices of {sorted(set(first) - seen)} are not among the candidates")
    assert not failures, f"{len(failures)} failures, the first ones:\n" + "\n".join(failures[:8])


@pytest.mark.parametrize("cin_g", [5, 6, 9, 10, 12, 18, 20])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("channels_last", [False, True])
def test_groups_whose_pixels_do_not_fill_128_bytes_evenly(cin_g, dtype, channels_last):
    # 128 // (12 bf16 channels' 24 bytes) is 5 groups, not a power of two: grouped_mma's default
    # groups_block rounds it down, and its check (not its tile table) then decides.
    params = dict(in_channels=8 * cin_g, out_channels=8 * 16, kernel_size=(3, 3), stride=1, padding=(1, 1),
                  dilation=1, groups=8, dtype=dtype, bias=True)
    problem = Problem(N=8, H=20, W=20, P=20, Q=20, device=nominal("sm_90a"))
    spec = select.choose(params, "cuda", problem, channels_last, "tf32")
    get_family(spec.family).check(spec, problem.device)
    fam = get_family("grouped_mma")
    base = ConvSpec(**params, device="cuda", layout="nhwc" if channels_last else "nchw",
                    math="tf32" if dtype == "float32" else "ieee", family="grouped_mma")
    gb = fam.default_tiles(base, problem)["groups_block"]
    assert gb in fam.tiles["groups_block"] and gb * cin_g * (4 if dtype == "float32" else 2) <= 128 or gb == 1


@pytest.mark.parametrize("family,kernel,tiles,why", [
    ("pointwise", (1, 1), {"block_n": 256, "async_x": 2, "block_k": 64, "min_blocks": 1}, "shared memory"),
    ("igemm", (3, 3), {"tile_p": 16, "tile_q": 128, "warps_m": 1, "warps_n": 1}, "accumulators"),
    ("wgmma", (3, 3), {"tile_p": 16, "tile_q": 128}, "accumulators"),
])
def test_forced_tiles_that_fit_no_configuration_say_which_and_why(family, kernel, tiles, why):
    """The refusal names the tiles the caller forced and the first candidate's reason, once, and
    not the placeholder tiles of the spec being chosen."""
    params = dict(in_channels=64, out_channels=128, kernel_size=kernel, stride=1, padding=0, dilation=1, groups=1,
                  dtype="float32", bias=False)
    problem = Problem(N=16, H=1024, W=1024, P=1024 - kernel[0] + 1, Q=1024 - kernel[1] + 1,
                      device=nominal("sm_90a"))
    with pytest.raises(ConvArgumentError) as info:
        select.choose(params, "cuda", problem, False, "tf32", family=family, tiles=tiles)
    msg = str(info.value)
    assert f"with the forced tiles {tiles}" in msg and why in msg, msg
    assert f"{family}: {family}:" not in msg and "block_k=8," not in msg, msg
