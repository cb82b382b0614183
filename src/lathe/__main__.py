"""`python -m lathe ...` is the `lathe` command (for machines where the console script is not installed)."""

import sys

from lathe.cli import main

sys.exit(main())
