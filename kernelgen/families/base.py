"""What a kernel family is: a template plus the rules for when it can serve a spec.

A family never decides *whether* it is the best choice (that is `dispatch.py`'s job);
it only says whether it *can* serve a spec (`check`, which raises `Unsupported`),
which tile parameters it takes and their allowed values, and sensible tiles for a
problem shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

from ..errors import Unsupported

if TYPE_CHECKING:  # pragma: no cover
    from ..spec import ConvSpec, Problem


# Shared memory of the card the tile rules size for (the H100): what one block may opt into
# (dynamic and static together), and an SM's whole (each resident block also reserves 1 KB).
SMEM_LIMIT = 227 * 1024
SM_SMEM = 228 * 1024


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

    def check(self, spec: "ConvSpec") -> None:
        """Raise Unsupported(reason) if this family cannot compute `spec` correctly."""
        if spec.device != self.device:
            raise Unsupported(f"{self.name} runs on {self.device}, not {spec.device}")
        if spec.dtype not in self.dtypes:
            raise Unsupported(f"{self.name} does not serve dtype {spec.dtype}")
        if spec.layout not in self.layouts:
            raise Unsupported(f"{self.name} does not take layout {spec.layout}")
        kh, kw = spec.kernel_size
        if not self.wide_weights and spec.out_channels * spec.cin_per_group * kh * kw >= 1 << 31:
            raise Unsupported(f"{self.name} indexes weights in 32 bits; this weight has 2^31 elements or more")
        self.check_shape(spec)

    def check_shape(self, spec: "ConvSpec") -> None:
        """Family-specific conditions (kernel size, groups, ...). Default: none."""

    def default_tiles(self, spec: "ConvSpec", problem: "Problem",
                      fixed: "Mapping[str, int] | None" = None) -> dict[str, int]:
        """Tile sizes for a problem shape; the default is each parameter's first value.

        `fixed`: tiles the caller forces; a family whose candidates interact (shared memory,
        registers) picks the others around them. The dispatcher applies them afterwards either way.
        """
        return {name: values[0] for name, values in self.tiles.items()}

    def context(self, spec: "ConvSpec") -> dict[str, object]:
        """Extra derived compile-time constants for the template (UPPERCASE keys)."""
        return {}
