"""Triton kernels of the `cuda` backend, one module per kernel family.

Each module has `@triton.jit` kernels, `plan_*` functions (shapes and parameters ->
`KernelLaunch`) and launchers that allocate outputs and run a plan (`launch.run`), on CUDA or,
for CPU tensors, through Triton's interpreter. Importing this package imports triton.
"""
