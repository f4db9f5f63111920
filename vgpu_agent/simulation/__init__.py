"""A simulated GPU that time-shares among containers launching kernels through the shim's token
rule, with NVML-like per-process utilization samples; it drives the real throttle controller in
tests, in the benchmark and in `vgpu-agent simulate`."""
