"""`python -m kernelgen`: the same as the `kernelgen` command (which, unlike this, answers
--help without importing torch: `python -m` imports the package first)."""

import sys

from kernelgen_cli import console

sys.exit(console())
