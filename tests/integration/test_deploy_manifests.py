"""deploy/: every variant renders with `kubectl kustomize` and validates strictly against the
Kubernetes 1.30 and 1.37 schemas (DRA variants: 1.34 and 1.36); the DaemonSet agrees with the
agent's config and CLI."""

from __future__ import annotations

import copy
import dataclasses
import os
import posixpath
from importlib import metadata
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import structlog
import yaml
from kubernetes_validate import utils as kv

from tests.integration.deploy_support import (
    DEPLOY,
    DRA_KUBE_VERSIONS,
    KUBE_VERSIONS,
    kustomizations,
    one,
    render,
    render_text,
    validate_files,
    variants,
    versions_for,
)
from vgpu_agent import cli, shiminstall
from vgpu_agent.config import Config, ConfigSources, build_config

DEFAULTS = Config()
EXPECTED_VARIANTS = {
    "base",
    "overlays/monitoring",
    "overlays/default-runtime",
    "overlays/hardened",
    "overlays/dra",
    "examples",
    "examples/dra",
}

# The fields of monitoring.coreos.com/v1 ServiceMonitor this project uses, strictly (no schema
# for custom resources ships with kubernetes-validate).
SERVICE_MONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "required": ["name", "namespace"],
            "properties": {
                "name": {"type": "string"},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            },
            "additionalProperties": False,
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {
                            "type": "object",
                            "additionalProperties": {"type": "string"},
                        }
                    },
                },
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"matchNames": {"type": "array", "items": {"type": "string"}}},
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["port"],
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string", "pattern": "^/"},
                            "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                            "scrapeTimeout": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                            "relabelings": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {
                                        "sourceLabels": {
                                            "type": "array",
                                            "items": {"type": "string"},
                                        },
                                        "targetLabel": {"type": "string"},
                                        "action": {"enum": ["replace", "keep", "drop"]},
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


def daemonset() -> dict[str, Any]:
    return one(render("base"), "DaemonSet", "vgpu-agent")


def pod_spec() -> dict[str, Any]:
    spec: dict[str, Any] = daemonset()["spec"]["template"]["spec"]
    return spec


def container(name: str) -> dict[str, Any]:
    spec = pod_spec()
    found = [c for c in spec["containers"] + spec.get("initContainers", []) if c["name"] == name]
    assert len(found) == 1
    return found[0]


def deployed_config() -> Config:
    configmap = one(render("base"), "ConfigMap")
    (text,) = configmap["data"].values()
    return build_config(ConfigSources(file_text=text, file_name="ConfigMap"))


def host_mounts(c: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """mountPath -> (hostPath, volume name) for the container's hostPath mounts."""
    volumes = {v["name"]: v for v in pod_spec()["volumes"]}
    return {
        m["mountPath"]: (volumes[m["name"]]["hostPath"]["path"], m["name"])
        for m in c["volumeMounts"]
        if "hostPath" in volumes[m["name"]]
    }


# --- rendering and schemas ----------------------------------------------------------------------


def test_the_expected_variants_exist_and_every_component_is_used() -> None:
    assert set(variants()) >= EXPECTED_VARIANTS
    used = set()
    for variant in variants():
        data = yaml.safe_load((DEPLOY / variant / "kustomization.yaml").read_text())
        for component in data.get("components", []):
            used.add(os.path.normpath(os.path.join(variant, component)))
    components = {p for p, kind in kustomizations().items() if kind == "Component"}
    assert {
        "components/servicemonitor",
        "components/default-runtime",
        "components/node-guard",
        "components/dra",
        "components/metrics-network-policy",
    } <= components
    assert components <= used, f"components no overlay renders: {sorted(components - used)}"


def test_validator_ships_the_schemas_we_validate_against() -> None:
    shipped = kv.all_versions()
    for version in KUBE_VERSIONS + DRA_KUBE_VERSIONS:
        assert version in shipped, f"kubernetes-validate has no schemas for {version}: {shipped}"


@pytest.fixture(scope="module")
def validation(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], list[str]]:
    """Every variant validated strictly against every version: one validator run per version."""
    out = tmp_path_factory.mktemp("rendered")
    files = {}
    for variant in variants():
        files[variant] = out / (variant.replace("/", "_") + ".yaml")
        files[variant].write_text(render_text(variant))
    results = {}
    for version in sorted(set(KUBE_VERSIONS + DRA_KUBE_VERSIONS)):
        wanted = {v: path for v, path in files.items() if version in versions_for(v)}
        report = validate_files(list(wanted.values()), version)
        for variant, path in wanted.items():
            results[variant, version] = report[path]
    return results


# every kustomization on disk, including ones added later, is rendered and validated
@pytest.mark.parametrize(
    ("variant", "version"), [(v, k) for v in variants() for k in versions_for(v)]
)
def test_variant_validates_strictly(
    variant: str, version: str, validation: dict[tuple[str, str], list[str]]
) -> None:
    problems = validation[variant, version]
    custom = [p for p in problems if "Couldn't find schema for kind ServiceMonitor" in p]
    assert [p for p in problems if p not in custom] == []
    monitors = [d for d in render(variant) if d["kind"] == "ServiceMonitor"]
    assert len(custom) == len(monitors)
    for monitor in monitors:
        jsonschema.validate(monitor, SERVICE_MONITOR_SCHEMA)


MISTAKES: list[tuple[list[Any], Any]] = [
    (["spec", "template", "spec", "containers", 0, "bogusField"], True),
    (["spec", "template", "spec", "containers", 0, "ports", 0, "containerPort"], "9394"),
    (["spec", "template", "spec", "hostPID"], "yes"),
    (["spec", "template", "spec", "tolerations", 0, "effect"], {"NoSchedule": True}),
]


def test_strict_validation_catches_mistakes(tmp_path: Path) -> None:
    files = []
    for n, (path, value) in enumerate(MISTAKES):
        broken = copy.deepcopy(daemonset())
        target = broken
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        files.append(tmp_path / f"broken{n}.yaml")
        files[-1].write_text(yaml.safe_dump(broken))
    for version in KUBE_VERSIONS:
        report = validate_files(files, version)
        for file, (path, value) in zip(files, MISTAKES, strict=True):
            assert report[file], f"strict {version} validation accepted {path}={value!r}"
            assert "did not validate" in report[file][0]


# --- the DaemonSet agrees with the agent --------------------------------------------------------


# Values the DaemonSet deliberately sets away from the agent's defaults.
DEPLOYED_OVERRIDES = {"host_proc_dir": "/host/proc"}


def test_configmap_is_the_agents_defaults() -> None:
    configmap = one(render("base"), "ConfigMap")
    (text,) = configmap["data"].values()
    raw = yaml.safe_load(text)
    config = deployed_config()
    for key in raw:
        expected = DEPLOYED_OVERRIDES.get(key, getattr(DEFAULTS, key))
        assert getattr(config, key) == expected, f"{key} differs from the default"
    image_config = (DEPLOY / "base" / "config.yaml").read_text()
    assert image_config == text


def test_host_paths_match_config_and_are_mounted_at_the_same_path() -> None:
    config = deployed_config()
    mounts = host_mounts(container("agent"))
    wanted = {
        config.device_plugin_dir,
        posixpath.dirname(config.pod_resources_socket),
        config.state_dir,
    }
    assert wanted == {
        DEFAULTS.device_plugin_dir,
        posixpath.dirname(DEFAULTS.pod_resources_socket),
        DEFAULTS.state_dir,
    }
    for path in wanted:
        assert mounts.get(path, ("", ""))[0] == path, f"{path} is not mounted from the host"
    # the host's /proc, read-only, where the agent's config looks for it
    assert mounts.get(config.host_proc_dir, ("", ""))[0] == "/proc"
    assert set(mounts) == wanted | {config.host_proc_dir}, "unexpected host mounts"
    init_mounts = host_mounts(container("install-shim"))
    assert init_mounts == {config.state_dir: (config.state_dir, "state")}


def test_install_shim_init_container_matches_the_installer() -> None:
    config = deployed_config()
    init = container("install-shim")
    command = init["command"]
    assert command[:2] == ["vgpu-agent", "install-shim"]
    args = shiminstall.build_parser().parse_args(command[2:])
    assert args.dest == Path(config.state_dir) / "shim"
    assert args.source == shiminstall.DEFAULT_SOURCE
    assert init["image"] == container("agent")["image"]
    assert DEFAULTS.container_shim_path == shiminstall.CONTAINER_SHIM_PATH


def test_ports_and_probes_match_the_metrics_address() -> None:
    _, port = deployed_config().metrics_host_port()
    agent = container("agent")
    (metrics,) = agent["ports"]
    assert (metrics["name"], metrics["containerPort"]) == ("metrics", port)
    assert agent["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert agent["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    service = one(render("base"), "Service")
    assert service["spec"]["clusterIP"] == "None"
    (service_port,) = service["spec"]["ports"]
    assert service_port["port"] == port and service_port["targetPort"] == "metrics"
    pod_labels = daemonset()["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()


def test_env_gives_node_name_namespace_and_nvml_access() -> None:
    env = {e["name"]: e for e in container("agent")["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"]["value"] == "utility"
    assert pod_spec()["runtimeClassName"] == "nvidia"
    for amounts in container("agent")["resources"].values():
        assert DEFAULTS.resource_name not in amounts, "the agent must not take a GPU slice"
    unknown = [n for n in env if n.startswith("VGPU_AGENT_")]
    for name in unknown:
        assert name[len("VGPU_AGENT_") :].lower() in vars(DEFAULTS), name


def test_the_agent_accepts_the_deployed_arguments_config_and_env(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = container("agent")
    args = list(agent["args"])
    config_path = args[args.index("--config") + 1]
    config_mount = next(m for m in agent["volumeMounts"] if m["name"] == "config")
    assert posixpath.dirname(config_path) == config_mount["mountPath"]
    configmap = one(render("base"), "ConfigMap")
    assert posixpath.basename(config_path) in configmap["data"]
    volume = next(v for v in pod_spec()["volumes"] if v["name"] == "config")
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]

    local = tmp_path / "config.yaml"
    local.write_text(configmap["data"][posixpath.basename(config_path)])
    args[args.index("--config") + 1] = str(local)
    for name in list(os.environ):
        if name.startswith("VGPU_AGENT_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("NODE_NAME", "gpu-node-7")
    saved = structlog.get_config()  # the CLI configures logging onto this test's captured stderr
    try:
        assert cli.main(["check-config", *args]) == 0
    finally:
        structlog.configure(**saved)
    out = capsys.readouterr().out
    assert "node_name: 'gpu-node-7'" in out
    assert f"state_dir: {DEFAULTS.state_dir!r}" in out


def test_security_context_is_least_privilege() -> None:
    spec = pod_spec()
    for key in ("hostPID", "hostIPC", "hostNetwork"):
        assert not spec.get(key), key
    assert spec["priorityClassName"] == "system-node-critical"
    assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    for c in spec["containers"] + spec["initContainers"]:
        sc = c["securityContext"]
        assert sc["capabilities"] == {"drop": ["ALL"]}, c["name"]
        assert sc["allowPrivilegeEscalation"] is False, c["name"]
        assert sc["readOnlyRootFilesystem"] is True, c["name"]
        assert not sc.get("privileged"), c["name"]
        assert c["resources"]["requests"] and c["resources"]["limits"]["memory"], c["name"]
    agent_mounts = {m["mountPath"]: m for m in container("agent")["volumeMounts"]}
    assert agent_mounts["/var/lib/kubelet/pod-resources"].get("readOnly") is True


def test_runs_on_gpu_nodes_with_their_taints() -> None:
    spec = pod_spec()
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    keys = {t["matchExpressions"][0]["key"] for t in terms["nodeSelectorTerms"]}
    assert {"nvidia.com/gpu.present", "vgpu.io/enabled"} <= keys
    assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])


def test_image_tag_is_the_package_version() -> None:
    version = metadata.version("vgpu-agent")
    for c in pod_spec()["containers"] + pod_spec()["initContainers"]:
        assert c["image"] == f"vgpu-agent:{version}", c["name"]


def test_default_runtime_overlay_only_drops_the_runtime_class() -> None:
    base = daemonset()
    overlay = one(render("overlays/default-runtime"), "DaemonSet", "vgpu-agent")
    assert "runtimeClassName" not in overlay["spec"]["template"]["spec"]
    expected = copy.deepcopy(base)
    del expected["spec"]["template"]["spec"]["runtimeClassName"]
    assert overlay == expected


def test_service_monitor_selects_the_metrics_service() -> None:
    docs = render("overlays/monitoring")
    monitor = one(docs, "ServiceMonitor")
    service = one(docs, "Service")
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert monitor["metadata"]["namespace"] == service["metadata"]["namespace"]
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [service["metadata"]["namespace"]]
    ports = {p["name"] for p in service["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports
    assert {e["path"] for e in monitor["spec"]["endpoints"]} == {"/metrics"}


def test_examples_ask_for_one_and_two_slices() -> None:
    pods = {p["metadata"]["name"]: p for p in render("examples") if p["kind"] == "Pod"}
    asked = {
        name: pod["spec"]["containers"][0]["resources"]["limits"][DEFAULTS.resource_name]
        for name, pod in pods.items()
    }
    assert asked == {
        "vgpu-one-slice": 1, "vgpu-two-slices": 2, "vgpu-inference": 1, "vgpu-batch": 1
    }


def test_inference_and_batch_examples_share_a_node_with_the_policies_they_say() -> None:
    from vgpu_agent.agent import pod_policy_rules
    from vgpu_agent.throttle.podpolicy import resolve

    pods = {p["metadata"]["name"]: p for p in render("examples") if p["kind"] == "Pod"}
    serving, batch = pods["vgpu-inference"], pods["vgpu-batch"]
    (term,) = batch["spec"]["affinity"]["podAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= serving["metadata"]["labels"].items()

    def chosen(pod: dict, config: Config):  # type: ignore[type-arg]
        namespace = pod["metadata"].get("namespace", "default")
        container = pod["spec"]["containers"][0]["name"]
        return resolve(pod["metadata"]["annotations"], namespace, container,
                       pod_policy_rules(config))

    deployed = deployed_config()
    listed = dataclasses.replace(deployed, pod_priority_namespaces=("default",))
    high, low = chosen(serving, listed), chosen(batch, listed)
    assert (high.policy, high.priority, high.refusals) == ("strict", 50, ())
    assert (low.policy, low.priority, low.refusals) == ("work-conserving", -10, ())
    # with the base configuration the namespace is not listed: the priority alone is refused
    (refusal,) = chosen(serving, deployed).refusals
    assert refusal.annotation == "vgpu.io/priority"
    assert chosen(batch, deployed).refusals == ()


def test_namespace_allows_host_paths() -> None:
    namespace = one(render("base"), "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    names = {d["metadata"].get("namespace") for d in render("base") if d["kind"] != "Namespace"}
    assert names <= {namespace["metadata"]["name"], None}
