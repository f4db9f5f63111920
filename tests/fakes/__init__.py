"""Fakes of the outside systems the agent talks to (NVML, the kubelet, ...)."""
