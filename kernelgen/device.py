"""What kernelgen needs to know of a GPU, read from the GPU once: `Device`.

The families' checks size tiles against a block's shared memory and registers, their tiles
aim for whole waves over the SMs, and the selector's cost model weighs bytes against the
DRAM's bandwidth and FLOPs against the tensor cores' rate. Every such number comes from
here: `of(index)` reads a GPU's properties through torch once per process; `nominal(arch)`
describes a typical part of a target for planning where no GPU is present (`kernelgen warm
--arch`, CPU-tier tests). No other module holds an SM count, a shared-memory size or a
bandwidth as a literal.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass

# Dense math per SM per clock, by architecture (the vendor's whitepapers): FP32 FMAs count two
# flops. These describe the architecture, not a part; the part's SM count and clock scale them.
FLOPS_PER_SM_CLOCK = {
    # arch: (fp32 FMA, TF32 tensor, 16-bit tensor)
    "sm_80": (128, 1024, 2048),
    "sm_86": (256, 512, 1024),
    "sm_89": (256, 512, 1024),
    "sm_90": (256, 2048, 4096),
}
# The targets kernelgen builds for; a family names the ones it runs on (Family.archs).
TARGETS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_90a")


@dataclass(frozen=True)
class Device:
    """A GPU as kernelgen plans for it.

    name: the GPU's name as the driver reports it ("NVIDIA H100 80GB HBM3").
    arch: the target kernelgen builds for it (sm_80, sm_89, sm_90a, ...).
    sms: streaming multiprocessors. smem_block: bytes of shared memory a block may opt into
    (static and dynamic together); smem_sm: an SM's whole; regs_sm: 32-bit registers an SM.
    l2_bytes: L2 cache. dram_bytes_s: DRAM bandwidth in bytes a second. clock_hz: the SMs'
    boost clock. source: "device" when read from a GPU, "nominal" when planned for one.
    """

    name: str
    arch: str
    sms: int
    smem_block: int
    smem_sm: int
    regs_sm: int
    l2_bytes: int
    dram_bytes_s: float
    clock_hz: float
    source: str = "device"

    @property
    def key(self) -> str:
        """The GPU model as a file-name-safe word ("nvidia-h100-80gb-hbm3"): what tables and tuned
        plan records are kept under."""
        return re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-") or self.arch

    def peak_flops(self, unit: str) -> float:
        """Dense flops a second of `unit`: 'fma' (float32 FMAs), 'tf32' or 'f16' (tensor cores)."""
        rates = FLOPS_PER_SM_CLOCK[self.arch.rstrip("a")] if self.arch.rstrip("a") in FLOPS_PER_SM_CLOCK \
            else FLOPS_PER_SM_CLOCK["sm_80"]
        per_clock = rates[("fma", "tf32", "f16").index(unit)]
        return per_clock * self.sms * self.clock_hz

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _part(name, arch, sms, smem_block_kb, smem_sm_kb, l2_mb, tb_s, ghz) -> Device:
    return Device(name=name, arch=arch, sms=sms, smem_block=smem_block_kb * 1024, smem_sm=smem_sm_kb * 1024,
                  regs_sm=65536, l2_bytes=l2_mb << 20, dram_bytes_s=tb_s * 1e12, clock_hz=ghz * 1e9,
                  source="nominal")


# Typical parts, for planning without the GPU (the vendors' data sheets).
_NOMINAL = {
    "sm_90a": _part("NVIDIA H100 80GB HBM3", "sm_90a", 132, 227, 228, 50, 3.35, 1.98),
    "sm_90a/wide": _part("NVIDIA H200", "sm_90a", 132, 227, 228, 60, 4.8, 1.98),
    "sm_90": _part("NVIDIA H100 80GB HBM3", "sm_90", 132, 227, 228, 50, 3.35, 1.98),
    "sm_89": _part("NVIDIA L40S", "sm_89", 142, 99, 100, 96, 0.864, 2.52),
    "sm_86": _part("NVIDIA A10", "sm_86", 72, 99, 100, 6, 0.6, 1.695),
    "sm_80": _part("NVIDIA A100-SXM4-80GB", "sm_80", 108, 163, 164, 40, 2.04, 1.41),
}


def nominal(arch: str = "sm_90a", wide_dram: bool = False) -> Device:
    """A typical GPU of target `arch` (wide_dram: Hopper's larger-memory parts, the H200 class)."""
    key = f"{arch}/wide" if wide_dram and f"{arch}/wide" in _NOMINAL else arch
    if key not in _NOMINAL:
        raise ValueError(f"no nominal GPU for target {arch!r}; known targets are {sorted(set(TARGETS))}")
    return _NOMINAL[key]


@functools.lru_cache(maxsize=None)
def of(index: int) -> Device:
    """The CUDA GPU `index` as torch reports it, read once per process."""
    import torch

    from .arch import arch_for_capability

    p = torch.cuda.get_device_properties(index)
    arch = arch_for_capability(p.major, p.minor)
    near = _NOMINAL.get(arch, _NOMINAL["sm_80"])
    # torch builds against CUDA 13 report neither clock (cudaDeviceProp dropped them): the bandwidth
    # is then measured, and the clock taken from the nominal part of the target.
    mem_khz, bus_bits = getattr(p, "memory_clock_rate", 0), getattr(p, "memory_bus_width", 0)
    dram = 2 * mem_khz * 1e3 * bus_bits / 8 if mem_khz and bus_bits else _measured_bandwidth(index)
    clock = getattr(p, "clock_rate", 0) * 1e3 or near.clock_hz
    return Device(name=p.name, arch=arch, sms=p.multi_processor_count,
                  smem_block=getattr(p, "shared_memory_per_block_optin", 0) or near.smem_block,
                  smem_sm=getattr(p, "shared_memory_per_multiprocessor", 0) or near.smem_sm,
                  regs_sm=getattr(p, "regs_per_multiprocessor", 0) or near.regs_sm,
                  l2_bytes=getattr(p, "L2_cache_size", 0) or near.l2_bytes, dram_bytes_s=float(dram),
                  clock_hz=float(clock))


def _measured_bandwidth(index: int) -> float:
    """Bytes a second a device-to-device copy of 256 MiB moves, read plus written (the median of
    five after one warm-up): a fraction of a millisecond, once per process, where the properties
    do not say."""
    import torch

    with torch.cuda.device(index):
        src = torch.empty(64 << 20, dtype=torch.float32, device="cuda")
        dst = torch.empty_like(src)
        times = []
        for i in range(6):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            if i:
                times.append(start.elapsed_time(end) / 1e3)
        del src, dst
    return 2 * (256 << 20) / sorted(times)[len(times) // 2]
