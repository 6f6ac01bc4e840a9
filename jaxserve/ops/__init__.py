"""Device operations the model and the step are built from.

`attention` (the paged-attention contract and XLA's reference implementation), `attention_backends`
(choosing XLA, the C++ CPU kernels or the Pallas GPU kernels, and the matmul backend), `cpu_ffi` with
`cpu_kernels/` (the C++ kernels XLA:CPU calls through its FFI, built at first use), `packed_matmul`
(the weights packed for the C++ matmul, and its calls) and `sampling` (the
on-device sampler). It may import `pallas_kernels` and config only.
"""
