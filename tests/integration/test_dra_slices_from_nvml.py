"""The ResourceSlice devices describe the GPUs as NVML reports them (real pynvml path on the
fake libnvidia-ml)."""

from __future__ import annotations

from pathlib import Path

import pynvml

from tests.fakes.fakenvml import FakeGpu, FakeNvml
from vgpu_agent.deviceplugin.allocation import Split
from vgpu_agent.dra.slices import build_spec
from vgpu_agent.gpu.nvml import NvmlBackend


def test_devices_carry_what_nvml_reports(fake_nvml: FakeNvml, tmp_path: Path) -> None:
    fake_nvml.set_gpus(
        [
            FakeGpu.make(0, "A100"),
            FakeGpu.make(1, "L4", numa=None, pci_bus_id="00000001:5E:00.0", minor=7),
        ]
    )
    fake_nvml.set_driver_version("535.104.05")
    backend = NvmlBackend(str(fake_nvml.library_path), sysfs_root=tmp_path / "sys")
    backend.start()
    try:
        gpus = backend.discover().gpus
        assert backend.driver_version == "535.104.05"
        spec = build_spec("node-a", "gpu.vgpu.io", gpus, Split(4), {}, 1, backend.driver_version)
    finally:
        backend.shutdown()
        for _ in range(100):  # leave no NVML init behind for the next test
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError:
                break
    a100, l4 = spec["devices"]
    assert a100["attributes"]["uuid"] == {"string": fake_nvml.uuids[0]}
    assert a100["attributes"]["architecture"] == {"string": "Ampere"}
    assert a100["attributes"]["cudaComputeCapability"] == {"version": "8.0.0"}
    assert a100["attributes"]["driverVersion"] == {"version": "535.104.5"}
    assert a100["attributes"]["numaNode"] == {"int": 0}
    assert a100["capacity"]["memory"]["value"] == "80Gi"
    assert l4["name"] == "gpu-1"
    assert l4["attributes"]["productName"] == {"string": "NVIDIA L4"}
    assert l4["attributes"]["architecture"] == {"string": "Ada Lovelace"}
    assert l4["attributes"]["pciBusID"] == {"string": "00000001:5E:00.0"}
    assert l4["attributes"]["minor"] == {"int": 7}
    assert "numaNode" not in l4["attributes"]  # NVML does not know it and sysfs has nothing
    assert l4["capacity"]["memory"]["requestPolicy"]["default"] == "6Gi"
