"""`python -m physarum` is the `physarum` CLI."""

import sys

from physarum.cli import main

sys.exit(main())
