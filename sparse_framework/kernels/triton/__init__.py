"""The kernels' `@triton.jit` code, one module per op; each op's launch code is the module of
the same name one level up (`kernels/<op>.py`). Nothing here imports a launch module."""
