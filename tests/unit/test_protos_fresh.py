"""The committed generated code matches protos/ (regenerating changes nothing) and the wire facts."""

import filecmp
import subprocess
from pathlib import Path

from vgpu_agent._proto.deviceplugin.v1beta1 import api_pb2 as dp
from vgpu_agent._proto.dra.v1 import api_pb2 as dra1
from vgpu_agent._proto.dra.v1beta1 import api_pb2 as dra1b
from vgpu_agent._proto.pluginregistration.v1 import api_pb2 as reg
from vgpu_agent._proto.podresources.v1 import api_pb2 as pr

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_not_stale(tmp_path):
    subprocess.run([str(ROOT / "scripts" / "gen-protos"), str(tmp_path)], check=True, cwd=ROOT)
    fresh = tmp_path / "vgpu_agent" / "_proto"
    committed = ROOT / "vgpu_agent" / "_proto"
    names = sorted(p.relative_to(fresh) for p in fresh.rglob("*") if p.is_file())
    assert names == sorted(
        p.relative_to(committed)
        for p in committed.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )
    stale = [str(n) for n in names if not filecmp.cmp(fresh / n, committed / n, shallow=False)]
    assert not stale, f"run scripts/gen-protos: stale generated files {stale}"


def field_numbers(message):
    return {f.name: f.number for f in message.DESCRIPTOR.fields}


def test_device_plugin_wire_names_and_numbers():
    assert dp.DESCRIPTOR.package == "v1beta1"
    services = {
        s.name: [m.name for m in s.methods] for s in dp.DESCRIPTOR.services_by_name.values()
    }
    assert services["Registration"] == ["Register"]
    assert services["DevicePlugin"] == [
        "GetDevicePluginOptions",
        "ListAndWatch",
        "GetPreferredAllocation",
        "Allocate",
        "PreStartContainer",
    ]
    assert field_numbers(dp.RegisterRequest) == {
        "version": 1,
        "endpoint": 2,
        "resource_name": 3,
        "options": 4,
    }
    assert field_numbers(dp.Device) == {"ID": 1, "health": 2, "topology": 3}
    assert field_numbers(dp.ContainerPreferredAllocationRequest) == {
        "available_deviceIDs": 1,
        "must_include_deviceIDs": 2,
        "allocation_size": 3,
    }
    assert field_numbers(dp.ContainerAllocateResponse) == {
        "envs": 1,
        "mounts": 2,
        "devices": 3,
        "annotations": 4,
        "cdi_devices": 5,
    }
    assert field_numbers(dp.Mount) == {"container_path": 1, "host_path": 2, "read_only": 3}
    assert field_numbers(dp.DevicePluginOptions) == {
        "pre_start_required": 1,
        "get_preferred_allocation_available": 2,
    }


def test_pod_resources_wire_names_and_numbers():
    assert pr.DESCRIPTOR.package == "v1"
    assert [m.name for m in pr.DESCRIPTOR.services_by_name["PodResourcesLister"].methods] == [
        "List",
        "GetAllocatableResources",
        "Get",
    ]
    assert field_numbers(pr.PodResources) == {"name": 1, "namespace": 2, "containers": 3}
    assert field_numbers(pr.ContainerDevices) == {
        "resource_name": 1,
        "device_ids": 2,
        "topology": 3,
    }
    assert field_numbers(pr.ContainerResources) == {
        "name": 1,
        "devices": 2,
        "cpu_ids": 3,
        "memory": 4,
        "dynamic_resources": 5,
    }
    assert field_numbers(pr.DynamicResource) == {
        "claim_name": 2,
        "claim_namespace": 3,
        "claim_resources": 4,
    }
    assert field_numbers(pr.ClaimResource) == {
        "cdi_devices": 1,
        "driver_name": 2,
        "pool_name": 3,
        "device_name": 4,
    }
    assert field_numbers(pr.CDIDevice) == {"name": 1}


def test_plugin_registration_wire_names_and_numbers():
    assert reg.DESCRIPTOR.package == "pluginregistration"
    service = reg.DESCRIPTOR.services_by_name["Registration"]
    assert service.full_name == "pluginregistration.Registration"
    assert [m.name for m in service.methods] == ["GetInfo", "NotifyRegistrationStatus"]
    assert field_numbers(reg.PluginInfo) == {
        "type": 1,
        "name": 2,
        "endpoint": 3,
        "supported_versions": 4,
    }
    assert field_numbers(reg.RegistrationStatus) == {"plugin_registered": 1, "error": 2}
    assert field_numbers(reg.InfoRequest) == {}
    assert field_numbers(reg.RegistrationStatusResponse) == {}


def test_dra_wire_names_and_numbers():
    for module, version in ((dra1, "v1"), (dra1b, "v1beta1")):
        assert module.DESCRIPTOR.package == f"k8s.io.kubelet.pkg.apis.dra.{version}"
        service = module.DESCRIPTOR.services_by_name["DRAPlugin"]
        assert [m.name for m in service.methods] == [
            "NodePrepareResources",
            "NodeUnprepareResources",
        ]
        assert field_numbers(module.Claim) == {"namespace": 1, "uid": 2, "name": 3}
        assert field_numbers(module.NodePrepareResourcesRequest) == {"claims": 1}
        assert field_numbers(module.NodePrepareResourcesResponse) == {"claims": 1}
        assert field_numbers(module.NodePrepareResourceResponse) == {"devices": 1, "error": 2}
        assert field_numbers(module.NodeUnprepareResourcesResponse) == {"claims": 1}
        assert field_numbers(module.NodeUnprepareResourceResponse) == {"error": 1}
        claims = module.NodePrepareResourcesResponse.DESCRIPTOR.fields_by_name["claims"]
        assert claims.message_type.GetOptions().map_entry  # map<uid, result>
    # The share ID for consumable capacity came to v1 later, under a new number; v1beta1 is frozen.
    assert field_numbers(dra1.Device) == {
        "request_names": 1,
        "pool_name": 2,
        "device_name": 3,
        "cdi_device_ids": 4,
        "share_id": 5,
    }
    assert dra1.Device.DESCRIPTOR.fields_by_name["share_id"].has_presence
    assert field_numbers(dra1b.Device) == {
        "request_names": 1,
        "pool_name": 2,
        "device_name": 3,
        "cdi_device_ids": 4,
    }
