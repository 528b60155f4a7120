"""The kernels' torch twins: the reference each Triton kernel is tested against and the path
that runs without Triton. Nothing here imports Triton or a launch module."""
