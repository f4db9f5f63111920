"""PodResources' dynamic resources map DRA regions (`<claim uid>-<device>`) to containers."""

from vgpu_agent._proto.podresources.v1 import api_pb2 as pr
from vgpu_agent.kubelet.podresources import ContainerRef, assignments_from

DRIVER = "gpu.vgpu.io"
UID = "00000000-0000-4000-8000-000000000001"


def claim_resource(device, cdi_names, driver=DRIVER):
    return pr.ClaimResource(
        cdi_devices=[pr.CDIDevice(name=n) for n in cdi_names],
        driver_name=driver,
        pool_name="node-a",
        device_name=device,
    )


def response(*containers):
    return pr.ListPodResourcesResponse(
        pod_resources=[pr.PodResources(name="pod", namespace="ns", containers=list(containers))]
    )


def test_claim_devices_map_to_their_container_by_the_uid_in_our_cdi_name():
    ctr = pr.ContainerResources(
        name="main",
        devices=[pr.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=["GPU-1::0"])],
        dynamic_resources=[
            pr.DynamicResource(
                claim_name="train",
                claim_namespace="ns",
                claim_resources=[
                    claim_resource("gpu-0", ["nvidia.com/gpu=GPU-0", f"{DRIVER}/claim={UID}"]),
                    claim_resource("gpu-1", ["nvidia.com/gpu=GPU-1"]),  # same claim, 2nd device
                    claim_resource("eth0", ["net.example.com/nic=eth0"], "net.example.com"),
                ],
            )
        ],
    )
    ref = ContainerRef("ns", "pod", "main")
    found = assignments_from(response(ctr), "nvidia.com/gpu", DRIVER)
    assert found == {"GPU-1::0": ref, f"{UID}-gpu-0": ref, f"{UID}-gpu-1": ref}
    # device-plugin mode ignores dynamic resources
    assert assignments_from(response(ctr), "nvidia.com/gpu") == {"GPU-1::0": ref}


def test_claims_without_one_of_our_uids_are_skipped():
    other_driver_name = claim_resource("gpu-0", ["other.io/claim=" + UID])
    two_uids = [
        claim_resource("gpu-0", [f"{DRIVER}/claim={UID}"]),
        claim_resource("gpu-1", [f"{DRIVER}/claim=another"]),
    ]
    bad_name = claim_resource("gpu-0", [f"{DRIVER}/claim=../../etc"])
    for resources in ([other_driver_name], two_uids, [bad_name]):
        ctr = pr.ContainerResources(
            name="main",
            dynamic_resources=[
                pr.DynamicResource(claim_name="c", claim_namespace="ns", claim_resources=resources)
            ],
        )
        assert assignments_from(response(ctr), "nvidia.com/gpu", DRIVER) == {}
