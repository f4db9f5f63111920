"""Stand-ins for the outside systems `vgpu-agent simulate` runs against: a Kubernetes API server
(core objects and `resource.k8s.io/v1`) and a DRA allocator that follows the scheduler's rules.
They live in the package, not under `tests/`, because `simulate --mode dra` runs the very ones the
tests use; the kubelet's stand-ins are in `vgpu_agent/kubelet/`."""
