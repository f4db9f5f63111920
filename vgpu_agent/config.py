"""The agent's configuration: one validated `Config`.

Layers, lowest first: defaults < YAML file < environment < flags.

Pure: callers hand in the file's text, the environment mapping and the parsed flags; nothing here
reads files or the process environment. Every rejected value raises `ConfigError`, whose message
names the key, the value, where it came from and what is allowed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import reprlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

ENV_PREFIX = "VGPU_AGENT_"
DEFAULT_XID_IGNORE = (13, 31, 43, 45, 68, 109)

AllocationPolicy = Literal["spread", "binpack"]
DeviceListStrategy = Literal["envvar", "cdi"]
Backend = Literal["nvml", "sim"]
LogFormat = Literal["json", "console"]
BackstopAction = Literal["report", "evict"]
CorePolicy = Literal["off", "strict", "work-conserving"]
MemoryOversubscription = Literal["off", "spill"]
Mode = Literal["device-plugin", "dra"]

# An extended resource name: a DNS-subdomain prefix outside kubernetes.io, a slash, and a
# qualified name (alphanumerics, '-', '_', '.', starting and ending alphanumeric, <= 63 chars).
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_RESOURCE_PREFIX = re.compile(rf"^{_DNS_LABEL}(\.{_DNS_LABEL})+$")
_RESOURCE_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(rf"^{_DNS_LABEL}(\.{_DNS_LABEL})*$")
_ADDRESS = re.compile(r"^(?P<host>\[[0-9a-fA-F:.]+\]|[^:\s\[\]]*):(?P<port>\d{1,5})$")


# Bounds on what a configuration may hold: values come from files and variables anyone with
# access to the DaemonSet can write, and none of them may hang or exhaust the agent at start.
MAX_CONFIG_BYTES = 64 * 1024  # the file, as read
MAX_YAML_NODES = 10_000  # values in the loaded file, counting every alias expansion
MAX_YAML_DEPTH = 32  # nested flow collections ([...] and {...})
MAX_SPLIT_COUNT = 128  # slices per GPU
MAX_MEMORY_SCALING = 10.0
MAX_STRING = 1024  # characters in a name, 4096 in a path
MAX_PATH = 4096
MAX_XIDS = 256
MAX_XID = 2**31 - 1
DAY_S = 86_400.0

_shown = reprlib.Repr()
_shown.maxstring = _shown.maxother = 120
_shown.maxlong = 40
_shown.maxlevel = 2
_shown.maxlist = _shown.maxdict = _shown.maxset = _shown.maxtuple = 8


def shown(value: object) -> str:
    """`value` as an error shows it: a repr cut short, whatever its size or nesting."""
    try:
        return _shown.repr(value)
    except Exception:  # a value whose repr fails is still named
        return f"<{type(value).__name__}>"


class ConfigError(ValueError):
    """A value that cannot be used; the message says which, why and what is allowed."""

    def __init__(self, key: str, value: object, allowed: str, source: str = ""):
        where = f" (from {source})" if source else ""
        text = f"invalid configuration: {key}={shown(value)}{where}: {allowed}"
        super().__init__(text if len(text) <= 2000 else text[:2000] + "...")
        self.key = key
        self.value = value
        self.allowed = allowed
        self.source = source


@dataclass(frozen=True)
class Config:
    """Everything the agent's behaviour depends on. Field names are the YAML keys."""

    resource_name: str = "nvidia.com/gpu"
    split_count: int = 4
    memory_scaling: float = 1.0
    allow_memory_oversubscription: bool = False
    # With memory_scaling > 1: "spill" serves allocations the card cannot hold from host memory.
    memory_oversubscription: MemoryOversubscription = "off"
    spill_host_memory_fraction: float = 0.5
    cores_scaling: float = 1.0
    allocation_policy: AllocationPolicy = "spread"
    device_list_strategy: DeviceListStrategy = "envvar"
    cdi_vendor_class: str = "nvidia.com/gpu"
    device_plugin_dir: str = "/var/lib/kubelet/device-plugins"
    pod_resources_socket: str = "/var/lib/kubelet/pod-resources/kubelet.sock"
    nvml_library: str | None = None
    backend: Backend = "nvml"
    sim_gpus: str = "2xA100-80GB"
    state_dir: str = "/var/lib/vgpu-agent"
    container_region_dir: str = "/run/vgpu"
    container_shim_path: str = "/usr/local/vgpu/libvgpu.so"
    metrics_address: str = "0.0.0.0:9394"
    node_name: str = ""
    xid_ignore: tuple[int, ...] = DEFAULT_XID_IGNORE
    health_recovery_seconds: float = 300.0
    health_check_seconds: float = 1.0
    log_format: LogFormat = "json"
    log_level: str = "info"
    kubeconfig: str | None = None
    core_policy: CorePolicy = "strict"
    throttle_tick_seconds: float = 0.1
    # how many times longer the tick grows while every container is settled (1: never slower)
    throttle_calm_slowdown: int = 4
    # the longest tick of a GPU where every container is settled and nothing is lent
    throttle_settled_tick_seconds: float = 2.0
    # NVML's per-process samples asked for once every this many sample periods (a GPU whose
    # estimates are loose or kernels changed, or whose periods two containers or more share
    # time-sliced, is asked every period all the same)
    throttle_nvml_poll_periods: int = 2
    # a container sharing a time-sliced GPU, never seen alone there, is given a turn alone
    throttle_solo_turns: bool = True
    # containers of this priority or more are never paused for a turn alone (None: none is)
    throttle_solo_turn_spare_priority: int | None = None
    # a figure measured in a turn alone this long ago is measured afresh (0: never by age)
    throttle_figure_max_age_seconds: float = 0.0
    host_proc_dir: str = "/proc"
    region_gc_grace_seconds: float = 30.0
    pod_resources_refresh_seconds: float = 5.0
    nvml_poll_seconds: float = 1.0
    hami_metrics: bool = False
    shim_allow_disable: bool = False
    shim_allow_region_dir: bool = False
    backstop_action: BackstopAction = "report"
    endpoint_name: str = "vgpu-agent.sock"
    mode: Mode = "device-plugin"
    dra_driver_name: str = "gpu.vgpu.io"
    plugin_registry_dir: str = "/var/lib/kubelet/plugins_registry"
    dra_plugin_dir: str = "/var/lib/kubelet/plugins"
    cdi_dir: str = "/var/run/cdi"
    # What pods may choose through their annotations (vgpu_agent/throttle/podpolicy.py).
    pod_core_policies: tuple[CorePolicy, ...] = ("strict", "work-conserving")
    pod_priority_max: int = 100
    pod_priority_namespaces: tuple[str, ...] = ()

    @property
    def plugin_socket(self) -> str:
        return f"{self.device_plugin_dir.rstrip('/')}/{self.endpoint_name}"

    @property
    def kubelet_socket(self) -> str:
        return f"{self.device_plugin_dir.rstrip('/')}/kubelet.sock"

    @property
    def dra_socket(self) -> str:
        """The DRA service the kubelet calls: `<dra_plugin_dir>/<driver>/dra.sock`."""
        return f"{self.dra_plugin_dir.rstrip('/')}/{self.dra_driver_name}/dra.sock"

    @property
    def registration_socket(self) -> str:
        """Where the kubelet's plugin watcher finds this driver: `<registry>/<driver>-reg.sock`."""
        return f"{self.plugin_registry_dir.rstrip('/')}/{self.dra_driver_name}-reg.sock"

    def metrics_host_port(self) -> tuple[str, int]:
        match = _ADDRESS.match(self.metrics_address)
        assert match is not None  # validated at construction
        host = match.group("host").strip("[]") or "0.0.0.0"
        return host, int(match.group("port"))


FIELD_NAMES = tuple(f.name for f in dataclasses.fields(Config))


# --- field checks: each turns a raw value (YAML type or env string) into the field's type -------


def _as_int(minimum: int, maximum: int) -> Callable[[str, object, str], int]:
    def check(key: str, raw: object, source: str) -> int:
        allowed = f"must be an integer >= {minimum} and <= {maximum}"
        value = raw
        if isinstance(raw, str):
            if len(raw) > 32:  # int() of thousands of digits costs time (or raises)
                raise ConfigError(key, raw, allowed, source)
            try:
                value = int(raw.strip(), 10)
            except ValueError:
                raise ConfigError(key, raw, allowed, source) from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, raw, allowed, source)
        if not minimum <= value <= maximum:
            raise ConfigError(key, raw, allowed, source)
        return value

    return check


def _as_float(allowed: str, ok: Callable[[float], bool]) -> Callable[[str, object, str], float]:
    def check(key: str, raw: object, source: str) -> float:
        value: float
        if isinstance(raw, bool):
            raise ConfigError(key, raw, allowed, source)
        if not isinstance(raw, str | int | float) or (isinstance(raw, str) and len(raw) > 64):
            raise ConfigError(key, raw, allowed, source)
        try:
            # OverflowError: an integer beyond any float
            value = float(raw.strip()) if isinstance(raw, str) else float(raw)
        except (ValueError, OverflowError):
            raise ConfigError(key, raw, allowed, source) from None
        if not math.isfinite(value) or not ok(value):  # NaN and infinity never pass
            raise ConfigError(key, raw, allowed, source)
        return value

    return check


def _seconds(low: float, high: float, zero: str = "") -> Callable[[str, object, str], float]:
    """A duration in seconds, finite, between `low` and `high` (both allowed)."""
    allowed = f"must be a number of seconds between {low:g} and {high:g}{zero}"
    return _as_float(allowed, lambda v: low <= v <= high)


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _as_bool(key: str, raw: object, source: str) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lower() in _TRUE | _FALSE:
        return raw.strip().lower() in _TRUE
    raise ConfigError(key, raw, "must be a boolean (true/false)", source)


def _as_choice(*choices: str) -> Callable[[str, object, str], str]:
    def check(key: str, raw: object, source: str) -> str:
        if not isinstance(raw, str) or raw not in choices:
            raise ConfigError(key, raw, "must be one of " + ", ".join(choices), source)
        return raw

    return check


def _as_oversubscription(key: str, raw: object, source: str) -> str:
    # YAML 1.1 reads a bare `off` as false: take it as the word that was written
    if raw is False:
        return "off"
    return str(_as_choice("off", "spill")(key, raw, source))


def _as_str(allow_empty: bool = True) -> Callable[[str, object, str], str]:
    def check(key: str, raw: object, source: str) -> str:
        if (
            not isinstance(raw, str)
            or (not allow_empty and not raw)
            or len(raw) > MAX_STRING
            or "\x00" in raw
        ):
            need = "a string" if allow_empty else "a non-empty string"
            allowed = f"must be {need} of at most {MAX_STRING} characters"
            raise ConfigError(key, raw, allowed, source)
        return raw

    return check


def _is_path(raw: object) -> bool:
    return isinstance(raw, str) and 0 < len(raw) <= MAX_PATH and "\x00" not in raw


def _as_abs_path(key: str, raw: object, source: str) -> str:
    if not _is_path(raw) or not isinstance(raw, str) or not raw.startswith("/"):
        raise ConfigError(key, raw, f"must be an absolute path (at most {MAX_PATH} bytes)", source)
    return raw


def _as_optional_path(key: str, raw: object, source: str) -> str | None:
    if raw is None or raw == "":
        return None
    if not _is_path(raw) or not isinstance(raw, str):
        allowed = f"must be a file path (at most {MAX_PATH} bytes) or empty"
        raise ConfigError(key, raw, allowed, source)
    return raw


_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def _as_socket_name(key: str, raw: object, source: str) -> str:
    allowed = (
        "must be a plain file name (letters, digits, '.', '_', '-', at most 64, no '/'), "
        "other than kubelet.sock"
    )
    if not isinstance(raw, str) or not _FILE_NAME.fullmatch(raw) or raw == "kubelet.sock":
        raise ConfigError(key, raw, allowed, source)
    return raw


def _as_resource_name(key: str, raw: object, source: str) -> str:
    allowed = (
        "must be an extended resource name '<domain>/<name>' such as nvidia.com/gpu "
        "(domain a DNS subdomain outside kubernetes.io, name of letters, digits, '-', '_', '.')"
    )
    if not isinstance(raw, str) or len(raw) > 253 + 1 + 63 or raw.count("/") != 1:
        raise ConfigError(key, raw, allowed, source)
    prefix, name = raw.split("/")
    if (
        not _RESOURCE_PREFIX.match(prefix)
        or len(prefix) > 253
        or prefix == "kubernetes.io"
        or prefix.endswith(".kubernetes.io")
        or not _RESOURCE_NAME.match(name)
        or len(name) > 63
    ):
        raise ConfigError(key, raw, allowed, source)
    return raw


def _as_dns_subdomain(key: str, raw: object, source: str) -> str:
    allowed = (
        "must be a DNS subdomain such as gpu.vgpu.io (lowercase letters, digits, '-' and '.', "
        "labels starting and ending alphanumeric, at most 253 characters)"
    )
    if (
        not isinstance(raw, str)
        or len(raw) > 253
        or not _DNS_SUBDOMAIN.match(raw)
        or any(len(label) > 63 for label in raw.split("."))
    ):
        raise ConfigError(key, raw, allowed, source)
    return raw


def _as_address(key: str, raw: object, source: str) -> str:
    allowed = (
        "must be HOST:PORT (e.g. 0.0.0.0:9394, 127.0.0.1:9394, [::]:9394) "
        "with port 0-65535 (0: any free port)"
    )
    if not isinstance(raw, str):
        raise ConfigError(key, raw, allowed, source)
    match = _ADDRESS.match(raw)
    if not match or not 0 <= int(match.group("port")) <= 65535:
        raise ConfigError(key, raw, allowed, source)
    return raw


def _as_xid_list(key: str, raw: object, source: str) -> tuple[int, ...]:
    allowed = "must be a list of XID numbers (non-negative integers), e.g. 13,31,43"
    items: list[object]
    if isinstance(raw, str):
        items = [part.strip() for part in raw.split(",") if part.strip()]
    elif isinstance(raw, list | tuple):
        items = list(raw)
    else:
        raise ConfigError(key, raw, allowed, source)
    if len(items) > MAX_XIDS:
        raise ConfigError(key, raw, f"{allowed}; at most {MAX_XIDS} of them", source)
    out: list[int] = []
    for item in items:
        if isinstance(item, bool) or (isinstance(item, str) and len(item) > 12):
            raise ConfigError(key, raw, allowed, source)
        try:
            number = int(item) if isinstance(item, int | str) else -1
        except ValueError:
            raise ConfigError(key, raw, allowed, source) from None
        if not 0 <= number <= MAX_XID:
            raise ConfigError(key, raw, allowed, source)
        out.append(number)
    return tuple(sorted(set(out)))


def _as_sim_gpus(key: str, raw: object, source: str) -> str:
    from vgpu_agent.gpu.simspec import parse_sim_spec

    if not isinstance(raw, str) or len(raw) > MAX_STRING:
        raise ConfigError(key, raw, "must be an inventory such as 2xA100-80GB,1xL4-24GB", source)
    try:
        parse_sim_spec(raw)
    except ValueError as err:
        raise ConfigError(key, raw, str(err), source) from None
    return raw


def _as_list(raw: object) -> list[object] | None:
    """A YAML list, or a comma-separated string (environment, flags); None for anything else."""
    if isinstance(raw, str):
        return [part.strip() for part in raw.split(",") if part.strip()]
    if isinstance(raw, list | tuple):
        return list(raw)
    return None


def _as_pod_policies(key: str, raw: object, source: str) -> tuple[str, ...]:
    choices = ("off", "strict", "work-conserving")
    allowed = "must be a list of core policies pods may choose, from " + ", ".join(choices)
    items = _as_list(raw)
    if items is not None:
        # YAML 1.1 reads a bare `off` as false: take it for the policy it names
        items = ["off" if i is False else i for i in items]
    if items is None or any(not isinstance(i, str) or i not in choices for i in items):
        raise ConfigError(key, raw, allowed, source)
    return tuple(sorted({str(i) for i in items}))


def _as_optional_priority(key: str, raw: object, source: str) -> int | None:
    """A priority as containers carry it (a pod's -100..100, a claim's 32-bit one), or none
    (null, or empty in the environment)."""
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return None
    try:
        return _as_int(-(2**31), 2**31 - 1)(key, raw, source)
    except ConfigError:
        raise ConfigError(key, raw, "must be an integer (a 32-bit one, as priorities are) or "
                          "empty for none", source) from None


def _as_pod_priority(key: str, raw: object, source: str) -> int:
    from vgpu_agent.throttle.podpolicy import PRIORITY_MAX, PRIORITY_MIN

    allowed = f"must be an integer in {PRIORITY_MIN}..{PRIORITY_MAX}"
    value = raw
    if isinstance(raw, str):
        try:
            value = int(raw.strip(), 10)
        except ValueError:
            raise ConfigError(key, raw, allowed, source) from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(key, raw, allowed, source)
    if not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise ConfigError(key, raw, allowed, source)
    return value


def _as_namespaces(key: str, raw: object, source: str) -> tuple[str, ...]:
    allowed = "must be a list of namespace names (DNS labels: a-z, 0-9, '-', at most 63)"
    items = _as_list(raw)
    if items is None:
        raise ConfigError(key, raw, allowed, source)
    for item in items:
        if not isinstance(item, str) or len(item) > 63 or not re.match(f"^{_DNS_LABEL}$", item):
            raise ConfigError(key, raw, allowed, source)
    return tuple(sorted({str(i) for i in items}))


_CHECKS: dict[str, Callable[[str, object, str], Any]] = {
    "resource_name": _as_resource_name,
    "split_count": _as_int(1, MAX_SPLIT_COUNT),
    "memory_scaling": _as_float(
        f"must be a number > 0 and <= {MAX_MEMORY_SCALING:g}",
        lambda v: 0 < v <= MAX_MEMORY_SCALING,
    ),
    "allow_memory_oversubscription": _as_bool,
    "memory_oversubscription": _as_oversubscription,
    "spill_host_memory_fraction": _as_float(
        "must be a number > 0 and <= 1 (a share of the host's memory)", lambda v: 0 < v <= 1
    ),
    "cores_scaling": _as_float("must be a number > 0 and <= 1", lambda v: 0 < v <= 1),
    "allocation_policy": _as_choice("spread", "binpack"),
    "device_list_strategy": _as_choice("envvar", "cdi"),
    "cdi_vendor_class": _as_str(allow_empty=False),
    "device_plugin_dir": _as_abs_path,
    "pod_resources_socket": _as_abs_path,
    "nvml_library": _as_optional_path,
    "backend": _as_choice("nvml", "sim"),
    "sim_gpus": _as_sim_gpus,
    "state_dir": _as_abs_path,
    "container_region_dir": _as_abs_path,
    "container_shim_path": _as_abs_path,
    "metrics_address": _as_address,
    "node_name": _as_str(),
    "xid_ignore": _as_xid_list,
    "health_recovery_seconds": _seconds(0, DAY_S, " (>= 0; 0 disables recovery)"),
    "health_check_seconds": _seconds(0.01, 60),
    "log_format": _as_choice("json", "console"),
    "log_level": _as_choice("debug", "info", "warning", "error"),
    "kubeconfig": _as_optional_path,
    "core_policy": _as_choice("off", "strict", "work-conserving"),
    "throttle_tick_seconds": _as_float(
        "must be a number between 0.01 and 10", lambda v: 0.01 <= v <= 10
    ),
    "throttle_calm_slowdown": _as_int(1, 10),
    "throttle_settled_tick_seconds": _seconds(0.1, 60),
    "throttle_nvml_poll_periods": _as_int(1, 5),
    "throttle_solo_turns": _as_bool,
    "throttle_solo_turn_spare_priority": _as_optional_priority,
    "throttle_figure_max_age_seconds": _seconds(0, DAY_S, " (0: never measured again by age)"),
    "host_proc_dir": _as_abs_path,
    "region_gc_grace_seconds": _seconds(0, DAY_S, " (>= 0)"),
    "pod_resources_refresh_seconds": _seconds(0.05, 3600, " (> 0)"),
    "nvml_poll_seconds": _as_float("must be a number between 0.1 and 60", lambda v: 0.1 <= v <= 60),
    "hami_metrics": _as_bool,
    "shim_allow_disable": _as_bool,
    "shim_allow_region_dir": _as_bool,
    "backstop_action": _as_choice("report", "evict"),
    "endpoint_name": _as_socket_name,
    "mode": _as_choice("device-plugin", "dra"),
    "dra_driver_name": _as_dns_subdomain,
    "plugin_registry_dir": _as_abs_path,
    "dra_plugin_dir": _as_abs_path,
    "cdi_dir": _as_abs_path,
    "pod_core_policies": _as_pod_policies,
    "pod_priority_max": _as_pod_priority,
    "pod_priority_namespaces": _as_namespaces,
}
assert set(_CHECKS) == set(FIELD_NAMES), "every Config field needs a check"


@dataclass
class ConfigSources:
    """The raw inputs, lowest precedence first. Flags hold only what the command line gave."""

    file_text: str | None = None
    file_name: str = "config file"
    env: Mapping[str, str] = field(default_factory=dict)
    flags: Mapping[str, object] = field(default_factory=dict)


def _parse_file(text: str, name: str) -> dict[str, object]:
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError("config", name, f"must be at most {MAX_CONFIG_BYTES} bytes")
    import yaml  # only with a config file: `run` from flags and env alone never needs it

    try:
        data = yaml.load(text, Loader=_bounded_loader())  # a SafeLoader
    except yaml.YAMLError as err:
        raise ConfigError("config", name, f"must be valid YAML: {shown(str(err))}") from None
    except (ValueError, OverflowError, RecursionError) as err:  # 5,000 digits; deep nesting
        raise ConfigError("config", name, f"must be valid YAML: {shown(str(err))}") from None
    if _nodes(data, MAX_YAML_NODES) > MAX_YAML_NODES:
        too_big = f"more than {MAX_YAML_NODES} values once its aliases are expanded"
        if isinstance(data, dict):
            for key, value in data.items():
                if _nodes(value, MAX_YAML_NODES) > MAX_YAML_NODES:
                    raise ConfigError(str(key)[:80], value, f"must not hold {too_big}", name)
        raise ConfigError("config", name, f"must not hold {too_big}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("config", name, "must be a YAML mapping of key: value")
    return {str(k): v for k, v in data.items()}


@functools.cache
def _bounded_loader() -> type:
    """The loader class, built (and yaml imported) the first time a file is parsed."""
    import yaml

    class _BoundedLoader(yaml.SafeLoader):
        """PyYAML's safe loader, bounded: flow collections nest at most `MAX_YAML_DEPTH` deep
        (the scanner's work grows with the square of the depth), and an integer too long to be
        a setting stays a string: `int()` of thousands of digits raises (or takes long); kept
        as text, the key's own check rejects it and the error names the key.
        """

        def fetch_flow_collection_start(self, TokenClass: type) -> None:
            if self.flow_level >= MAX_YAML_DEPTH:
                raise yaml.scanner.ScannerError(
                    None, None, f"collections nested deeper than {MAX_YAML_DEPTH}", self.get_mark()
                )
            super().fetch_flow_collection_start(TokenClass)

        def construct_yaml_int(self, node: yaml.ScalarNode) -> object:  # type: ignore[override]
            if isinstance(node.value, str) and len(node.value) > 32:
                return node.value
            return super().construct_yaml_int(node)

    _BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_yaml_int)
    return _BoundedLoader


def _nodes(data: object, budget: int) -> int:
    """How many values `data` holds with every alias expanded, counting no further than `budget`.

    Aliases make a loaded document a graph that shares its parts; walking it as a tree visits a
    shared part once per reference, so an alias bomb of a few hundred bytes is billions of
    values. The walk stops as soon as the budget is spent.
    """
    count = 0
    stack = [data]
    while stack and count <= budget:
        item = stack.pop()
        count += 1
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple | set | frozenset):
            stack.extend(item)
    return count


def build_config(sources: ConfigSources) -> Config:
    """Merge defaults < file < environment < flags, validating every value on the way."""
    values: dict[str, object] = {}
    layers: list[tuple[str, Mapping[str, object]]] = []
    if sources.file_text is not None:
        layers.append((sources.file_name, _parse_file(sources.file_text, sources.file_name)))
    env_values = {
        name[len(ENV_PREFIX) :].lower(): value
        for name, value in sources.env.items()
        if name.startswith(ENV_PREFIX)
    }
    layers.append(("environment", env_values))
    layers.append(("command line", sources.flags))
    for source, layer in layers:
        for key, raw in layer.items():
            if key not in _CHECKS:
                shown = ENV_PREFIX + key.upper() if source == "environment" else key
                raise ConfigError(
                    shown, raw, "unknown key; known keys: " + ", ".join(FIELD_NAMES), source
                )
            label = ENV_PREFIX + key.upper() if source == "environment" else key
            values[key] = _CHECKS[key](label, raw, source)
    if "node_name" not in values and "NODE_NAME" in sources.env:
        values["node_name"] = sources.env["NODE_NAME"]
    config = Config(**values)  # type: ignore[arg-type]
    _check_combinations(config)
    return config


def _check_combinations(config: Config) -> None:
    if (
        config.memory_scaling > 1
        and not config.allow_memory_oversubscription
        and config.memory_oversubscription != "spill"
    ):
        raise ConfigError(
            "memory_scaling",
            config.memory_scaling,
            "values above 1 hand out more memory than the GPU has; set "
            "memory_oversubscription: spill (what the card cannot hold is served from host "
            "memory) or allow_memory_oversubscription: true (limits only, no spilling)",
        )
    if len(config.plugin_socket) > 107:
        raise ConfigError(
            "device_plugin_dir",
            config.device_plugin_dir,
            "the plugin socket path must fit a unix socket address (107 bytes)",
        )
    if config.mode == "dra":
        for key, path in (
            ("dra_plugin_dir", config.dra_socket),
            ("plugin_registry_dir", config.registration_socket),
        ):
            if len(path) > 107:
                raise ConfigError(
                    key,
                    getattr(config, key),
                    f"the socket path {path} must fit a unix socket address (107 bytes)",
                )


def missing_for_mode(config: Config, env: Mapping[str, str]) -> list[str]:
    """What the chosen mode needs and does not have, each said so a user can fix it.

    DRA mode reads ResourceClaims and publishes ResourceSlices: without an API server and this
    node's name it could only fail every Prepare, so it does not start.
    """
    if config.mode != "dra":
        return []
    missing = []
    if not config.kubeconfig and not env.get("KUBERNETES_SERVICE_HOST"):
        missing.append(
            "a Kubernetes API: --kubeconfig / VGPU_AGENT_KUBECONFIG, or in-cluster config "
            "(KUBERNETES_SERVICE_HOST is not set)"
        )
    if not config.node_name:
        missing.append("the node name: --node-name, VGPU_AGENT_NODE_NAME or NODE_NAME")
    return missing
