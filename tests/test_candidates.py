"""Every configuration a family declares it can run renders, and (nvcc) a sample of them compiles.

The tuner builds and times what `Family.candidates` lists, not only a family's first choice, so a
candidate that does not compile is a failure a user would meet. CPU tier: over a grid of calls
(dtypes, precisions, layouts, 1x1 / k x k / strided / grouped / depthwise / first layers, odd
channel counts), every candidate of every family renders and passes its family's check on the GPU
it was listed for; nvcc lowers a seeded sample of them to SASS for sm_90a, and for sm_80 where the
family declares it, in parallel, without spills where a family promises none.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import tempfile
from pathlib import Path

import pytest

from kernelgen import select
from kernelgen.device import nominal
from kernelgen.families import all_families, get_family
from kernelgen.render import render
from kernelgen.spec import ConvSpec, Problem
from lowering import lower

# (N, C, K, H, W, kernel, stride, padding, groups)
LAYERS = [
    (8, 64, 128, 28, 28, 3, 1, 1, 1), (32, 256, 64, 14, 14, 1, 1, 0, 1), (4, 3, 32, 64, 64, 3, 2, 1, 1),
    (8, 96, 96, 28, 28, 3, 1, 1, 96), (8, 128, 128, 14, 14, 3, 1, 1, 32), (8, 256, 256, 14, 14, 3, 1, 1, 16),
    (2, 75, 185, 9, 9, 1, 1, 0, 1),
    (4, 16, 128, 128, 128, 3, 1, 1, 1), (16, 64, 128, 64, 64, 1, 1, 0, 1), (2, 24, 48, 32, 32, (1, 7), 1, (0, 3), 1),
]
CELLS = [("float32", "tf32"), ("float32", "ieee"), ("bfloat16", "ieee")]


def _grid():
    for i, (N, C, K, H, W, k, s, p, g) in enumerate(LAYERS):
        for dtype, math in CELLS:
            for channels_last in (False, True):
                params = dict(in_channels=C, out_channels=K, kernel_size=k, stride=s, padding=p, dilation=1, groups=g,
                              dtype=dtype, bias=i % 2 == 0)
                P, Q = ConvSpec(**params).output_size(H, W)
                for arch in ("sm_90a", "sm_80"):
                    yield params, Problem(N, H, W, P, Q, device=nominal(arch)), channels_last, math, arch


def _every():
    """(family, arch, spec) for every candidate of the grid."""
    out = {}
    for params, problem, cl, math, arch in _grid():
        for spec in select.ranked(params, "cuda", problem, cl, math, every=True):
            out[(spec, arch)] = spec.family
    return [(fam, arch, spec) for (spec, arch), fam in out.items()]


EVERY = _every()


def test_every_cuda_family_lists_candidates_on_the_grid():
    listed = {fam for fam, _, _ in EVERY}
    assert listed == {n for n, f in all_families().items() if f.device == "cuda"}
    # and more than its first choice somewhere: the tuner has configurations to compare
    by_family: dict[str, set] = {}
    for fam, arch, spec in EVERY:
        by_family.setdefault(fam, set()).add(spec.tiles)
    assert all(len(t) > 1 for f, t in by_family.items() if get_family(f).tiles), by_family.keys()


def test_every_candidate_renders_and_passes_its_check_on_its_gpu():
    failures = []
    for fam, arch, spec in EVERY:
        try:
            get_family(fam).check(spec, nominal(arch))
            assert render(spec).cuda
        except Exception as exc:  # collected, so that one run names every failing candidate
            failures.append(f"{arch} {spec.summary()}: {type(exc).__name__}: {exc}")
    assert not failures, f"{len(failures)} of {len(EVERY)} candidates fail:\n" + "\n".join(failures[:8])


def _sample(per_family: int = 3, seed: int = 52):
    rng = random.Random(seed)
    by_family: dict[tuple, list] = {}
    for fam, arch, spec in EVERY:
        by_family.setdefault((fam, arch), []).append(spec)
    return [(arch, spec) for (fam, arch), specs in sorted(by_family.items())
            for spec in rng.sample(specs, min(per_family, len(specs)))]


@pytest.mark.compile
@pytest.mark.nvcc
def test_a_sample_of_candidates_compiles_for_each_declared_target():
    sample = _sample()

    def one(item):
        arch, spec = item
        with tempfile.TemporaryDirectory() as d:
            try:
                lower(spec, Path(d), arch=arch)
            except AssertionError as exc:
                return f"{arch} {spec.summary()}: {str(exc)[-1500:]}"
        return None

    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        failures = [f for f in pool.map(one, sample) if f]
    assert not failures, f"{len(failures)} of {len(sample)} fail to compile:\n" + "\n\n".join(failures[:4])


def test_a_family_that_packs_weights_packs_them_once_per_version():
    """The packing contract (packs.py): a candidate with PACKED_BYTES packs into a->wp only when
    the caller says the weights are not ready there and reports it; one without never touches wp."""
    wrong = []
    for fam, arch, spec in EVERY:
        source = render(spec).cuda
        packs = spec.template_context()["PACKED_BYTES"] > 0
        if packs != ("a->wp" in source) or (packs and not ("a->wp_ready" in source and "KG_DONE_PACKED" in source)):
            wrong.append(f"{arch} {spec.summary()}: PACKED_BYTES {spec.template_context()['PACKED_BYTES']}")
    assert not wrong, "\n".join(wrong[:8])
