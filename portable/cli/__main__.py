"""`python -m portable.cli`: the same as the `portable` console script."""

import sys

from .app import main

sys.exit(main())
