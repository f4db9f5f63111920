"""Dynamic Resource Allocation: the second kubelet-facing front door."""
