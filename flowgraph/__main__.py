"""`python -m flowgraph` is the `flowgraph` command."""

import sys

from flowgraph.cli import main

if __name__ == "__main__":  # not in a process spawned from it (asynchronous rollouts)
    sys.exit(main())
