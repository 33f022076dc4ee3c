"""`python -m flowgraph` is the `flowgraph` command."""

import sys

from flowgraph.cli import main

sys.exit(main())
