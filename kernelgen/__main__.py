"""`python -m kernelgen`: the same as the `kernelgen` command."""

import sys

from .cli import main

sys.exit(main())
