"""flowgraph.nodes: the node implementations, plain torch.

Pure functions or small nn.Modules; no Ray, no collective, no sharded tensor and no
rollout engine in here: a node asks its `NodeContext` for those services
(`flowgraph.runtime.context`; tests/test_boundaries.py holds the line). The
registry (`flowgraph.kinds`) names each kind's implementation as `module:function`;
executors import them lazily.
"""
