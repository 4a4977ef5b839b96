"""CPU-tier tests of the dispatcher as a whole: every call F.conv2d accepts gets a spec.

The family tests check each family's own choices; this one walks many shapes of grouped, dense
and depthwise layers, in every dtype, precision and layout, on both Hopper DRAM classes and on
sm_80, and asks only that the dispatcher answers with a spec its family accepts. A family's
default tiles that its own table refuses (grouped_mma once chose 5 groups a block for bf16 groups
of 12 channels, and every such NCHW call raised) fail here rather than in a user's call.
"""

from __future__ import annotations

import random

import pytest

from kernelgen import dispatch
from kernelgen.families import get_family
from kernelgen.errors import ConvArgumentError
from kernelgen.spec import ConvSpec, Problem


def _calls(seed: int, n: int):
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
                   bias=rng.random() < 0.5), hw, rng.random() < 0.5, math


@pytest.mark.parametrize("arch,wide", [("sm_90a", False), ("sm_90a", True), ("sm_80", False)])
def test_every_call_gets_a_spec_its_family_accepts(arch, wide):
    failures = []
    for params, hw, channels_last, math in _calls(1234, 600):
        P, Q = ConvSpec(**params).output_size(*hw)
        problem = Problem(N=8, H=hw[0], W=hw[1], P=P, Q=Q, arch=arch, wide_dram=wide)
        try:
            spec = dispatch.choose(params, "cuda", problem, channels_last, math)
            get_family(spec.family).check(spec)
        except Exception as exc:  # collected, so that one run names every failing shape
            failures.append(f"{params} {hw} channels_last={channels_last} {math}: {type(exc).__name__}: {exc}")
    assert not failures, f"{len(failures)} calls failed, the first ones:\n" + "\n".join(failures[:8])


@pytest.mark.parametrize("cin_g", [5, 6, 9, 10, 12, 18, 20])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("channels_last", [False, True])
def test_groups_whose_pixels_do_not_fill_128_bytes_evenly(cin_g, dtype, channels_last):
    # 128 // (12 bf16 channels' 24 bytes) is 5 groups, not a power of two: grouped_mma's default
    # groups_block rounds it down, and its check (not its tile table) then decides.
    params = dict(in_channels=8 * cin_g, out_channels=8 * 16, kernel_size=(3, 3), stride=1, padding=(1, 1),
                  dilation=1, groups=8, dtype=dtype, bias=True)
    problem = Problem(N=8, H=20, W=20, P=20, Q=20, arch="sm_90a")
    spec = dispatch.choose(params, "cuda", problem, channels_last, "tf32")
    get_family(spec.family).check(spec)
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
    problem = Problem(N=16, H=1024, W=1024, P=1024 - kernel[0] + 1, Q=1024 - kernel[1] + 1, arch="sm_90a")
    with pytest.raises(ConvArgumentError) as info:
        dispatch.choose(params, "cuda", problem, False, "tf32", family=family, tiles=tiles)
    msg = str(info.value)
    assert f"with the forced tiles {tiles}" in msg and why in msg, msg
    assert f"{family}: {family}:" not in msg and "block_k=8," not in msg, msg
