"""Device facts (kernelgen/device.py): read from the GPU once, nominal parts for planning without one."""

from __future__ import annotations

import types

import pytest
import torch

from kernelgen import device
from kernelgen.device import Device, nominal
from kernelgen.families import get_family
from kernelgen.spec import ConvSpec


def test_nominal_parts_of_each_target():
    h100, h200, a100, l40s = nominal("sm_90a"), nominal("sm_90a", wide_dram=True), nominal("sm_80"), nominal("sm_89")
    assert (h100.sms, h100.smem_block, h100.smem_sm) == (132, 227 * 1024, 228 * 1024)
    assert h200.dram_bytes_s > h100.dram_bytes_s and h200.key == "nvidia-h200"
    assert a100.smem_block == 163 * 1024 and l40s.smem_block == 99 * 1024
    assert all(d.source == "nominal" for d in (h100, h200, a100, l40s))
    assert nominal("sm_80", wide_dram=True) == a100  # no larger part known: the target's own
    with pytest.raises(ValueError, match="sm_75"):
        nominal("sm_75")


def test_peak_rates_follow_the_architecture():
    h100 = nominal("sm_90a")
    assert h100.peak_flops("f16") == 2 * h100.peak_flops("tf32") == 16 * h100.peak_flops("fma")
    assert 900e12 < h100.peak_flops("f16") < 1100e12


def _props(**over):
    base = dict(name="NVIDIA H100 80GB HBM3", major=9, minor=0, multi_processor_count=132,
                shared_memory_per_block_optin=232448, shared_memory_per_multiprocessor=233472,
                regs_per_multiprocessor=65536, L2_cache_size=52428800, memory_clock_rate=2619000,
                memory_bus_width=5120, clock_rate=1980000, total_memory=80 << 30)
    base.update(over)
    return types.SimpleNamespace(**base)


def test_facts_are_read_from_the_gpu_once(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: calls.append(i) or _props())
    device.of.cache_clear()
    try:
        d = device.of(0)
        assert device.of(0) is d and calls == [0]
        assert (d.arch, d.sms, d.smem_block, d.l2_bytes) == ("sm_90a", 132, 232448, 52428800)
        assert d.dram_bytes_s == pytest.approx(2 * 2619000e3 * 5120 / 8)
        assert d.key == "nvidia-h100-80gb-hbm3" and d.source == "device"
    finally:
        device.of.cache_clear()


def test_a_gpu_whose_properties_lack_the_memory_clock_is_measured(monkeypatch):
    props = _props()
    del props.memory_clock_rate, props.clock_rate
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(device, "_measured_bandwidth", lambda i: 3.0e12)
    device.of.cache_clear()
    try:
        d = device.of(0)
        assert d.dram_bytes_s == 3.0e12 and d.clock_hz == nominal("sm_90a").clock_hz
    finally:
        device.of.cache_clear()


def test_a_familys_checks_size_tiles_against_the_gpu_they_are_for():
    # a 128 KB ring fits an A100 (163 KB a block) and an H100 (227 KB), not an L40S (99 KB)
    fam = get_family("nhwc")
    spec = ConvSpec(256, 256, 3, padding=1, dtype="bfloat16", layout="nhwc", family="nhwc",
                    tiles={"block_m": 128, "block_n": 128, "chunks": 8, "stages": 4, "wg": 0, "min_blocks": 1})
    need = fam.layout(spec, dict(spec.tiles))["SMEM_BYTES"]
    assert nominal("sm_89").smem_block < need <= nominal("sm_90a").smem_block
    fam.check(spec, nominal("sm_80"))
    with pytest.raises(Exception, match="shared memory"):
        fam.check(spec, nominal("sm_89"))


def test_families_declare_their_targets():
    for name in ("wgmma", "nhwc_tma", "pointwise_tma"):
        assert get_family(name).archs == ("sm_90a",)
    for name in ("nhwc", "igemm", "pointwise", "pointwise_tile", "depthwise", "direct", "grouped_mma", "stem_nhwc"):
        assert {"sm_80", "sm_89", "sm_90a"} <= set(get_family(name).archs)
