"""Run the five KernelBench convolution cases and print one table.

For each case: Model (PyTorch) and ModelNew (kernelgen) compared on several fresh
random inputs (KernelBench's torch.allclose at 1e-2, and relative error against a
float64 F.conv2d), then timed side by side. See _harness.py for the accuracy rules.
Exits non-zero if any case fails or errors. Run from the repository root:

    python examples/run_all.py [--precision ieee|tf32|bf16] [--device cpu]

Without a CUDA device the same five cases run on the CPU at reduced shapes, and the
table's heading says so.
"""

import sys
from pathlib import Path

import _harness

EXAMPLES = (
    "conv_pointwise",  # 87
    "conv_asymmetric_kernel",  # 56
    "conv_square",  # 63
    "conv_depthwise",  # 84
    "conv_depthwise_kx1",  # 83
)


def main(argv=None) -> int:
    opts = _harness.parse_args(argv, description=__doc__.strip().splitlines()[0])
    _harness.require_kernelgen()
    _harness.show_compiles()
    results = []
    for name in EXAMPLES:
        result = _harness.run_case_safely(Path(_harness.EXAMPLES_DIR, f"{name}.py"), opts)
        if result.error is None:
            print(_harness.compile_line(result), flush=True)
        print(_harness.result_line(result), flush=True)
        results.append(result)
    print()
    print(_harness.table(results, opts))
    print()
    print(_harness.compile_summary(results))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
