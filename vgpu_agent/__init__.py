"""vgpu-agent: a Kubernetes node agent that serves enforced, measured vGPU slices."""

__version__ = "0.1.0"
