"""`python -m qlens` runs the `qlens` command."""

import sys

from qlens.cli import main

sys.exit(main())
