"""What a kernel family is: a template plus the rules for when it can serve a spec.

A family never decides *whether* it is the best choice (that is `select.py`'s job, from
measurements); it only says what it *can* run: whether it can serve a spec on a GPU (`check`,
which raises `Unsupported`, every launch precondition decided there), which tile parameters it
takes and their allowed values, its own first choice of tiles for a problem (`default_tiles`) and
every configuration it can compile and launch for one (`candidates`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

from ..device import TARGETS
from ..errors import Unsupported

if TYPE_CHECKING:  # pragma: no cover
    from ..device import Device
    from ..spec import ConvSpec, Problem


def target(device: "Device | None") -> "Device":
    """The GPU a check or a tile rule sizes for: `device`, or where none is named (CPU-tier tests,
    specs checked apart from a call) a nominal H100."""
    from ..device import nominal

    return device if device is not None else nominal("sm_90a")


def element_size(spec: "ConvSpec") -> int:
    """Bytes of one element, for the families that take float32 and the 16-bit types."""
    return 4 if spec.dtype == "float32" else 2


def staged_row(pixels: int, esize: int) -> int:
    """Elements from one staged output row to the next (templates/common/staging.cuh.j2): room
    for `pixels` and a shift of up to one 16-byte chunk, the stride 32 bytes (float32: 8-byte
    fragment writes) or 16 bytes (16-bit: 4-byte writes) past a multiple of 128, which keeps
    the fragment writes of eight rows free of bank conflicts."""
    need, step, rem = pixels + 16 // esize, 128 // esize, (32 if esize == 4 else 16) // esize
    return need + (rem - need) % step


def pow2_at_most(n: int, cap: int) -> int:
    """The largest power of two no more than `n` and `cap` (1 at least)."""
    v = 1
    while v * 2 <= min(n, cap):
        v *= 2
    return v


def check_dense_1x1(name: str, spec: "ConvSpec") -> None:
    """Raise Unsupported unless `spec` is a dense (one group) 1x1 convolution at stride 1 without
    padding: the per-image GEMMs' own shape, X[n] read as it lies."""
    if spec.groups != 1:
        raise Unsupported(f"{name} serves dense layers (groups=1)")
    if spec.kernel_size != (1, 1) or spec.stride != (1, 1) or any(spec.padding):
        raise Unsupported(f"{name} serves 1x1 kernels at stride 1 without padding (got kernel {spec.kernel_size}, "
                          f"stride {spec.stride}, padding {spec.padding})")


def no_fit(fixed: Mapping[str, int] | None, reasons: list[str]) -> str:
    """The message of a family that found no tiles: the tiles the caller forced, if any, and why
    the first candidate failed."""
    forced = f" with the forced tiles {dict(fixed)}" if fixed else ""
    why = reasons[0] if reasons else "the forced tiles take none of its candidates' values"
    return f"no tile configuration fits{forced} ({why})"


def first_fit(check: Callable[[dict], None], walks: Iterable[tuple[Mapping[str, int], Iterable[tuple[int, int]]]],
              fixed: Mapping[str, int]) -> dict:
    """The first tiles that `check` accepts (it raises Unsupported): for each (base, depths) in
    `walks`, `base` with each (min_blocks, stages) of `depths` that the forced tiles `fixed` allow
    (a forced pair outside `depths` tried alone). Raises Unsupported with the first refusal's
    reason where none fits."""
    reasons = []
    for base, depths in walks:
        order = [(b, s) for b, s in depths if fixed.get("min_blocks", b) == b and fixed.get("stages", s) == s]
        if not order and "min_blocks" in fixed and "stages" in fixed:
            order = [(fixed["min_blocks"], fixed["stages"])]
        for blocks, stages in order:
            cand = {**base, "stages": stages, "min_blocks": blocks}
            try:
                check(cand)
            except Unsupported as exc:
                reasons.append(str(exc))
                continue
            return cand
    raise Unsupported(no_fit(fixed, reasons or ["no ring depth matches them"]))


@dataclass(frozen=True)
class Family:
    """A template family.

    name: the family's name, used in specs, cache listings and logs.
    device: 'cuda' or 'cpu'.
    template: path of the template under `templates/`.
    layouts: memory layouts the kernel can be handed ('any' means it honours strides).
    dtypes: dtypes it serves.
    tiles: tile parameter name -> allowed values; a spec's tiles must name each one.
    tf32: whether it has a TF32 tensor-core path (MATH='tf32'); families without one
        always compute exact float32 and specs for them carry MATH='ieee'.
    wide_weights: whether it indexes weights in 64 bits (KgW::at64). The others index in
        32 bits and refuse weights of 2^31 elements or more.
    aligned_input: whether it needs its (dense) input to start on a 16-byte boundary, as the
        TMA does: a call whose input view starts between two is handed a copy that does not.
    archs: the CUDA targets it compiles and runs on.
    engine: what it computes on, for the cost model: 'wgmma', 'mma' (mma.sync), 'fma' (float32
        FMAs of a tuned stencil) or 'direct' (the general loops).
    nchw_copy: whether an NCHW call's input is first transposed into its workspace (one more pass).
    row_tile: output columns of one row a tile covers, for families that tile each image's rows
        (a narrower row leaves the rest of the tile idle); 0 for those that tile pixels over the batch.
    epilogue: whether its template applies the fused epilogue (an activation, a residual:
        templates/common/epilogue.cuh.j2) where it writes the output; one that does not is
        never handed a spec with one.
    scale: whether its template also applies the epilogue's per-channel scale (HAS_SCALE: the
        accumulator times a float32 scale before the bias); one that does not is never handed a
        spec with one.
    """

    name: str
    device: str
    template: str
    layouts: tuple[str, ...]
    dtypes: tuple[str, ...]
    tiles: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    tf32: bool = False
    wide_weights: bool = False
    aligned_input: bool = False
    archs: tuple[str, ...] = TARGETS
    engine: str = "direct"
    nchw_copy: bool = False
    row_tile: int = 0
    epilogue: bool = False
    scale: bool = False

    def check(self, spec: "ConvSpec", device: "Device | None" = None) -> None:
        """Raise Unsupported(reason) if this family cannot compute `spec` correctly on `device`
        (None: a nominal H100), launch preconditions included."""
        if spec.device != self.device:
            raise Unsupported(f"{self.name} runs on {self.device}, not {spec.device}")
        if spec.dtype not in self.dtypes:
            raise Unsupported(f"{self.name} does not serve dtype {spec.dtype}")
        if spec.layout not in self.layouts:
            raise Unsupported(f"{self.name} does not take layout {spec.layout}")
        if spec.epilogue and not self.epilogue:
            raise Unsupported(f"{self.name} does not fuse epilogues (activation {spec.activation}"
                              f"{', residual' if spec.residual else ''}{', scale' if spec.scale else ''})")
        if spec.scale and not self.scale:
            raise Unsupported(f"{self.name} does not apply an epilogue scale")
        kh, kw = spec.kernel_size
        if not self.wide_weights and spec.out_channels * spec.cin_per_group * kh * kw >= 1 << 31:
            raise Unsupported(f"{self.name} indexes weights in 32 bits; this weight has 2^31 elements or more")
        device = target(device)
        self.check_arch(device)
        self.check_shape(spec, device)

    def check_arch(self, device: "Device") -> None:
        """Raise Unsupported unless this family runs on `device`'s target."""
        if self.device == "cuda" and device.arch not in self.archs:
            raise Unsupported(f"{self.name} runs on {', '.join(self.archs)} (target {device.arch})")

    def check_target(self, device: "Device | None") -> None:
        """check_arch where the GPU is known; where it is not (planning with no GPU and no target
        named), a family that runs on some targets only is refused, since the GPU may be another."""
        if device is not None:
            self.check_arch(device)
        elif self.device == "cuda" and set(self.archs) != set(TARGETS):
            raise Unsupported(f"{self.name} runs on {', '.join(self.archs)} only, and the target is unknown "
                              "(name it: kernelgen warm/render --arch)")

    def check_shape(self, spec: "ConvSpec", device: "Device") -> None:
        """Family-specific conditions (kernel size, groups, tiles against `device`). Default: none."""

    def default_tiles(self, spec: "ConvSpec", problem: "Problem",
                      fixed: "Mapping[str, int] | None" = None) -> dict[str, int]:
        """The family's own first choice of tiles for a problem; the default is each parameter's
        first value.

        `fixed`: tiles the caller forces; a family whose candidates interact (shared memory,
        registers) picks the others around them. The caller applies them afterwards either way.
        """
        return {name: values[0] for name, values in self.tiles.items()}

    def candidates(self, spec: "ConvSpec", problem: "Problem",
                   fixed: "Mapping[str, int] | None" = None) -> list["ConvSpec"]:
        """Every configuration of this family that can compile and launch for `spec` (its family,
        math and layout set) on `problem`'s GPU, each a checked spec: its own first choice first,
        then the tiles it picks around each other allowed value of each tile parameter, in the
        order of its tile space. `fixed` tiles hold in all of them. Empty where it cannot run."""
        from ..errors import ConvArgumentError

        try:
            self.check_target(problem.device)
        except Unsupported:
            return []
        device = target(problem.device)
        fixed = dict(fixed or {})
        forcings = [{}] + [{name: v} for name, values in self.tiles.items() if name not in fixed for v in values]
        out, seen = [], set()
        for force in forcings:
            pinned = {**force, **fixed}
            try:
                tiles = {**self.default_tiles(spec, problem, fixed=pinned), **pinned}
                cand = spec.replace(family=self.name, tiles=tuple(tiles.items()))
                self.check(cand, device)
            except (Unsupported, ConvArgumentError):
                continue
            if cand.tiles not in seen:
                seen.add(cand.tiles)
                out.append(cand)
        return out

    def context(self, spec: "ConvSpec") -> dict[str, object]:
        """Extra derived compile-time constants for the template (UPPERCASE keys)."""
        return {}

    # -- what the cost model needs to know of a configuration (costmodel.py) ------------------
    def unit(self, spec: "ConvSpec") -> str:
        """'tensor' where the configuration multiplies on tensor cores, else 'fma'."""
        return "tensor" if self.cost_class(spec) in ("wgmma", "mma") else "fma"

    def cost_class(self, spec: "ConvSpec") -> str:
        """The engine of this configuration (a key of costmodel.PRIORS)."""
        return self.engine

    def traffic(self, spec: "ConvSpec", problem: "Problem") -> float:
        """Bytes the configuration moves through DRAM: input, weights and output once, and the
        input twice more where an NCHW input is transposed into the workspace first."""
        from ..spec import ELEMENT_BYTES

        kh, kw = spec.kernel_size
        x = problem.N * spec.in_channels * problem.H * problem.W
        w = spec.out_channels * spec.cin_per_group * kh * kw
        y = problem.N * spec.out_channels * problem.P * problem.Q
        copy = 2 * x if self.nchw_copy and spec.layout == "nchw" else 0
        return float(x + w + y + copy) * ELEMENT_BYTES[spec.dtype]

    def work(self, spec: "ConvSpec", problem: "Problem") -> float:
        """Flops the configuration computes, padding included: tensor cores take whole k-steps of
        input channels a group (8 float32, 16 16-bit) and whole MMA rows of output channels a group
        (64 for wgmma, 16 for mma.sync), and a tile of `row_tile` columns runs whole."""
        kh, kw = spec.kernel_size
        cin, cout, q = spec.cin_per_group, spec.cout_per_group, problem.Q
        if self.unit(spec) == "tensor":
            step = 8 if spec.dtype == "float32" else 16
            cin = -(-cin // step) * step
            rows = 64 if self.cost_class(spec) == "wgmma" else 16
            cout = -(-cout // rows) * rows
        if self.row_tile:
            q = -(-q // self.row_tile) * self.row_tile
        return 2.0 * problem.N * problem.P * q * spec.groups * cout * cin * kh * kw

    def tiles_of(self, spec: "ConvSpec", problem: "Problem") -> int:
        """Blocks of work the configuration launches, roughly: output tiles of 128 pixels x 128
        channels."""
        return -(-problem.N * problem.P * problem.Q // 128) * -(-spec.out_channels // 128)
