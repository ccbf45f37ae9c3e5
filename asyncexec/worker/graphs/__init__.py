"""Graph mode, one runner per device kind, built and owned by the `ModelRunner`: `cuda.CUDAGraphRunner`
(CUDA graphs) and `cpu.CPUGraphRunner` (decoder layers compiled by inductor)."""
