"""deploy/ for DRA mode: the DRA DaemonSet runs beside the device-plugin one on its own node
pool, mounts the kubelet's plugin directories, and the DeviceClass and examples agree with the
slices the agent publishes (checked with the test allocator)."""

from __future__ import annotations

import collections
import posixpath
from typing import Any

import pytest
import structlog

from tests.fakes.dra_allocator import Allocator
from tests.fakes.kubeapi import gpu
from tests.integration.deploy_support import one, render
from vgpu_agent import cli
from vgpu_agent.config import Config
from vgpu_agent.deviceplugin.allocation import Split
from vgpu_agent.dra.quantity import parse
from vgpu_agent.dra.slices import build_spec
from vgpu_agent.gpu.model import MIB
from vgpu_agent.kube.resourceslices import DEFAULT_DRIVER

DEFAULTS = Config()
GIB = 1024 * MIB
DRA_DIRS = {"/var/lib/kubelet/plugins_registry", "/var/lib/kubelet/plugins", "/var/run/cdi"}


def dra_daemonset() -> dict[str, Any]:
    return one(render("overlays/dra"), "DaemonSet")


def terms(daemonset: dict[str, Any]) -> list[list[dict[str, Any]]]:
    affinity = daemonset["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
    required = affinity["requiredDuringSchedulingIgnoredDuringExecution"]
    return [t["matchExpressions"] for t in required["nodeSelectorTerms"]]


def agent(daemonset: dict[str, Any]) -> dict[str, Any]:
    (container,) = [
        c for c in daemonset["spec"]["template"]["spec"]["containers"] if c["name"] == "agent"
    ]
    return container


def test_the_two_daemonsets_split_the_gpu_nodes() -> None:
    dra = dra_daemonset()
    assert terms(dra) == [[{"key": "vgpu.io/mode", "operator": "In", "values": ["dra"]}]]
    base = one(render("base"), "DaemonSet")
    for expressions in terms(base):
        assert {"key": "vgpu.io/mode", "operator": "NotIn", "values": ["dra"]} in expressions
    # its own selector, so neither DaemonSet counts the other's pods as its own
    assert dra["spec"]["selector"]["matchLabels"]["vgpu.io/mode"] == "dra"
    assert "vgpu.io/mode" not in base["spec"]["selector"]["matchLabels"]


def test_base_and_dra_overlay_apply_side_by_side() -> None:
    docs = render("base") + render("overlays/dra")
    names = collections.Counter(
        (d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in docs
    )
    assert [key for key, count in names.items() if count > 1] == []
    dra = render("overlays/dra")
    assert not [d for d in dra if d["kind"] in ("Namespace", "Service")]
    daemonset = dra_daemonset()
    service = one(render("base"), "Service")
    assert service["spec"]["selector"].items() <= (
        daemonset["spec"]["template"]["metadata"]["labels"].items()
    ), "the metrics Service no longer finds the DRA agents"
    account = daemonset["spec"]["template"]["spec"]["serviceAccountName"]
    assert account == "vgpu-agent-dra"
    assert one(dra, "ServiceAccount")["metadata"]["name"] == account
    configmap = one(dra, "ConfigMap")
    volume = next(
        v for v in daemonset["spec"]["template"]["spec"]["volumes"] if v["name"] == "config"
    )
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]


def test_dra_agent_mounts_the_kubelet_plugin_dirs_at_the_same_paths() -> None:
    daemonset = dra_daemonset()
    volumes = {v["name"]: v for v in daemonset["spec"]["template"]["spec"]["volumes"]}
    mounts = {
        m["mountPath"]: volumes[m["name"]]["hostPath"]["path"]
        for m in agent(daemonset)["volumeMounts"]
        if "hostPath" in volumes[m["name"]]
    }
    for path in DRA_DIRS:
        assert mounts.get(path) == path, f"{path} is not mounted from the host"
    for m in agent(daemonset)["volumeMounts"]:
        if m["mountPath"] in DRA_DIRS:
            assert not m.get("readOnly"), "the agent creates sockets and CDI specs there"
    # everything else the base mounts is still there
    base = one(render("base"), "DaemonSet")
    base_paths = {m["mountPath"] for m in agent(base)["volumeMounts"]}
    assert {m["mountPath"] for m in agent(daemonset)["volumeMounts"]} == base_paths | DRA_DIRS


def test_dra_agent_runs_in_dra_mode(
    tmp_path: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    args = list(agent(dra_daemonset())["args"])
    assert args[args.index("--mode") + 1] == "dra"
    if "mode" not in vars(DEFAULTS):
        pytest.skip("this build of the agent has no `mode` option yet")
    configmap = one(render("overlays/dra"), "ConfigMap")
    local = tmp_path / "config.yaml"
    local.write_text(configmap["data"][posixpath.basename(args[args.index("--config") + 1])])
    args[args.index("--config") + 1] = str(local)
    monkeypatch.setenv("NODE_NAME", "gpu-node-7")
    saved = structlog.get_config()
    try:
        assert cli.main(["check-config", *args]) == 0
    finally:
        structlog.configure(**saved)
    assert "mode: 'dra'" in capsys.readouterr().out


def test_device_class_selects_the_driver_and_maps_the_resource_name() -> None:
    device_class = one(render("overlays/dra"), "DeviceClass")
    assert device_class["metadata"]["name"] == DEFAULT_DRIVER
    assert device_class["spec"]["extendedResourceName"] == DEFAULTS.resource_name
    assert device_class["spec"]["selectors"] == [
        {"cel": {"expression": f'device.driver == "{DEFAULT_DRIVER}"'}}
    ]


def allocate_example(request: dict[str, Any], gpus_free: int = 1) -> dict[str, Any]:
    device_class = one(render("overlays/dra"), "DeviceClass")
    published = {
        "metadata": {"name": "slice"},
        "spec": build_spec("node-a", DEFAULT_DRIVER, [gpu(i) for i in range(gpus_free)],
                           Split(DEFAULTS.split_count), {}, 1),
    }
    claim = {"metadata": {"name": "c", "uid": "u"},
             "spec": {"devices": {"requests": [request]}}}
    result: dict[str, Any] = Allocator([published], [device_class]).allocate(claim)
    return result


def test_the_example_claim_gets_its_memory_and_cores_from_a_published_gpu() -> None:
    template = one(render("examples/dra"), "ResourceClaimTemplate")
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    result = allocate_example(request)["devices"]["results"][0]
    assert result["driver"] == DEFAULT_DRIVER and result["device"] == "gpu-0"
    assert parse(result["consumedCapacity"]["memory"]) == 10 * GIB
    assert parse(result["consumedCapacity"]["cores"]) == 30
    pod = one(render("examples/dra"), "Pod", "vgpu-dra-claim")
    (claim,) = pod["spec"]["resourceClaims"]
    assert claim["resourceClaimTemplateName"] == template["metadata"]["name"]
    assert pod["spec"]["containers"][0]["resources"]["claims"] == [{"name": claim["name"]}]


def test_the_extended_resource_example_gets_one_default_share() -> None:
    pod = one(render("examples/dra"), "Pod", "vgpu-dra-extended-resource")
    assert pod["spec"]["containers"][0]["resources"]["limits"] == {DEFAULTS.resource_name: 1}
    assert pod["spec"]["nodeSelector"] == {"vgpu.io/mode": "dra"}
    # what the scheduler's claim for the class asks: one device, no amounts
    result = allocate_example({"name": "container-0-request-0", "exactly": {
        "deviceClassName": DEFAULT_DRIVER}})["devices"]["results"][0]
    split = Split(DEFAULTS.split_count)
    assert parse(result["consumedCapacity"]["memory"]) == split.slice_memory(80 * GIB)
    assert parse(result["consumedCapacity"]["cores"]) == split.slice_cores()
