"""flowgraph.nodes: the node implementations, plain torch.

Pure functions or small nn.Modules; no Ray and no torch.distributed in here. The
registry (`flowgraph.kinds`) names each kind's implementation as `module:function`;
executors import them lazily.
"""
