"""flowgraph.compilers.vllm — the vLLM rollout engine (`engine`) and the weight sync into it
(`weight_sync`)."""
