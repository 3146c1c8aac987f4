"""IR -> code: Triton kernels for fused groups, comm kernels, the per-graph wrapper module."""
