"""`python -m gb10d` is the `gb10d` command."""

import sys

from .cmdline.cli import main

sys.exit(main())
