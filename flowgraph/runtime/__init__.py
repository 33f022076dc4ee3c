"""flowgraph.runtime: what executors hand to node implementations.

Plain Python; torch is imported only by the modules that touch tensors.
"""

from flowgraph.runtime.context import NodeContext

__all__ = ["NodeContext"]
