"""Command line: parses arguments, builds the `Config`, hands it to the agent. Nothing else."""

from __future__ import annotations

import argparse
import asyncio
import os
import stat
import sys
from collections.abc import Callable, Sequence

from vgpu_agent import __version__
from vgpu_agent.config import (
    MAX_CONFIG_BYTES,
    Config,
    ConfigError,
    ConfigSources,
    build_config,
    missing_for_mode,
)

EXIT_CONFIG = 2

# flag -> config key; every flag defaults to "not given" so lower layers show through.
_FLAGS: dict[str, tuple[str, str]] = {
    "--device-plugin-dir": ("device_plugin_dir", "kubelet device plugin directory"),
    "--pod-resources-socket": ("pod_resources_socket", "kubelet PodResources socket"),
    "--nvml-library": ("nvml_library", "load this libnvidia-ml instead of the system one"),
    "--backend": ("backend", "GPU backend: nvml or sim"),
    "--sim-gpus": ("sim_gpus", "simulated GPUs, e.g. 2xA100-80GB,1xL4-24GB"),
    "--split-count": ("split_count", "slices per physical GPU (1 <= K <= 128)"),
    "--memory-scaling": (
        "memory_scaling",
        "memory scaling S (0 < S <= 10; > 1 needs --memory-oversubscription spill or "
        "--allow-memory-oversubscription)",
    ),
    "--memory-oversubscription": (
        "memory_oversubscription",
        "with memory scaling above 1: off (limits only) or spill (to host memory)",
    ),
    "--spill-host-memory-fraction": (
        "spill_host_memory_fraction",
        "share of host memory that S x GPU memory, summed over GPUs, may reach with spill (0..1]",
    ),
    "--cores-scaling": ("cores_scaling", "cores scaling (0 < x <= 1)"),
    "--allocation-policy": ("allocation_policy", "spread or binpack"),
    "--device-list-strategy": ("device_list_strategy", "envvar or cdi"),
    "--state-dir": ("state_dir", "host directory for regions and the shim"),
    "--metrics-address": ("metrics_address", "HOST:PORT for /metrics, /healthz, /readyz"),
    "--node-name": ("node_name", "this node's name (default: $NODE_NAME)"),
    "--log-format": ("log_format", "json or console"),
    "--log-level": ("log_level", "debug, info, warning or error"),
    "--kubeconfig": ("kubeconfig", "kubeconfig file (default: in-cluster config when present)"),
    "--core-policy": ("core_policy", "default core policy: off, strict or work-conserving"),
    "--resource-name": ("resource_name", "extended resource name to advertise"),
    "--mode": ("mode", "kubelet front door: device-plugin or dra"),
    "--dra-driver-name": ("dra_driver_name", "DRA driver name (a DNS subdomain)"),
    "--plugin-registry-dir": ("plugin_registry_dir", "kubelet plugin watcher directory"),
    "--dra-plugin-dir": ("dra_plugin_dir", "kubelet plugins directory (socket <dir>/<driver>/)"),
    "--cdi-dir": ("cdi_dir", "directory for CDI spec files"),
    "--pod-core-policies": (
        "pod_core_policies",
        "core policies pods may choose by annotation, comma-separated",
    ),
    "--pod-priority-max": ("pod_priority_max", "highest priority a pod may take (-100..100)"),
    "--pod-priority-namespaces": (
        "pod_priority_namespaces",
        "namespaces whose pods may take priorities above 0, comma-separated",
    ),
}


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML configuration file")
    for flag, (key, text) in _FLAGS.items():
        parser.add_argument(flag, dest=key, default=argparse.SUPPRESS, help=text)
    parser.add_argument(
        "--allow-memory-oversubscription",
        dest="allow_memory_oversubscription",
        action="store_const",
        const=True,
        default=argparse.SUPPRESS,
        help="allow memory scaling above 1",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vgpu-agent", description=__doc__)
    parser.add_argument("--version", action="version", version=f"vgpu-agent {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = commands.add_parser("run", help="run the node agent")
    _add_config_flags(run)
    simulate = commands.add_parser(
        "simulate", help="run the agent on simulated GPUs with an in-process kubelet stand-in"
    )
    _add_config_flags(simulate)
    simulate.add_argument(
        "--duration", type=float, default=0.0, help="stop after SECONDS (0: until Ctrl-C)"
    )
    simulate.add_argument(
        "--view",
        choices=("auto", "on", "off"),
        default="auto",
        help="the live `top` view instead of share log lines (auto: when stdout is a terminal;"
        " the log then goes to a file)",
    )
    check = commands.add_parser("check-config", help="validate the configuration and print it")
    _add_config_flags(check)
    top = commands.add_parser(
        "top", help="live view of a node's GPUs, slices and containers (reads /status)"
    )
    top.add_argument(
        "--url",
        default="http://127.0.0.1:9394/status",
        help="the agent's status URL, or its base URL (default: %(default)s)",
    )
    top.add_argument(
        "--interval", type=_interval, default=1.0, help="seconds between frames (0.1..3600)"
    )
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    top.add_argument("--json", action="store_true", help="print the raw status document")
    commands.add_parser(
        "install-shim",
        help="install libvgpu.so into the host state dir (see: vgpu-agent install-shim --help)",
    )
    return parser


def _interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.1 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed: seconds in 0.1..3600")
    return value


def load_config(
    args: argparse.Namespace, env: dict[str, str], overrides: dict[str, object] | None = None
) -> Config:
    flags = {key: getattr(args, key) for key, _ in _FLAGS.values() if hasattr(args, key)}
    if hasattr(args, "allow_memory_oversubscription"):
        flags["allow_memory_oversubscription"] = True
    text, name = None, "config file"
    if args.config:
        text = read_config_file(args.config)
        name = args.config
    merged_flags: dict[str, object] = {**(overrides or {}), **flags}
    return build_config(ConfigSources(file_text=text, file_name=name, env=env, flags=merged_flags))


def read_config_file(path: str) -> str:
    """The file's text, read no further than the size a configuration may have.

    Only a regular file (a symlink to one, as a mounted ConfigMap is) is read, opened
    non-blocking so that a FIFO cannot hang the start, and never past the size cap.
    """
    allowed = f"must be a readable UTF-8 file of at most {MAX_CONFIG_BYTES} bytes"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # /dev/zero, a FIFO, a directory
                raise ConfigError("--config", path, f"{allowed} (it is not a regular file)")
            chunks: list[bytes] = []
            size = 0
            while size <= MAX_CONFIG_BYTES:
                chunk = os.read(fd, MAX_CONFIG_BYTES + 1 - size)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
        finally:
            os.close(fd)
    except OSError as err:
        raise ConfigError("--config", path, f"{allowed} ({err.strerror})") from None
    if size > MAX_CONFIG_BYTES:
        raise ConfigError("--config", path, f"{allowed} (it is larger)")
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError("--config", path, f"{allowed} (byte {err.start} is not UTF-8)") from None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["install-shim"]:
        # The installer parses its own flags (argparse's REMAINDER would drop leading options).
        from vgpu_agent.shiminstall import main as install_main

        return install_main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_CONFIG
    if args.command == "top":
        from vgpu_agent.top import run_top

        return run_top(args.url, args.interval, once=args.once, as_json=args.json)
    env = dict(os.environ)
    try:
        if args.command == "simulate":
            from vgpu_agent.simulate import simulate_defaults

            config = load_config(args, env, simulate_defaults())
        else:
            config = load_config(args, env)
    except ConfigError as err:
        print(f"vgpu-agent: {err}", file=sys.stderr)
        return EXIT_CONFIG

    from vgpu_agent.logging import configure

    configure(config.log_format, config.log_level)
    if args.command == "check-config":
        for key, value in sorted(vars(config).items()):
            print(f"{key}: {value!r}")
        return 0
    if args.command == "simulate":
        from vgpu_agent.simulate import simulate

        return _run_reporting_os_errors(
            lambda: asyncio.run(
                simulate(
                    config,
                    duration=args.duration,
                    view=args.view == "on" or (args.view == "auto" and sys.stdout.isatty()),
                )
            )
        )
    missing = missing_for_mode(config, env)
    if missing:
        print(f"vgpu-agent: mode {config.mode} needs {'; and '.join(missing)}", file=sys.stderr)
        return EXIT_CONFIG
    from vgpu_agent.agent import SHUTDOWN_DEADLINE_S, Agent, run_process

    agent = Agent(config, exit_process_after_s=SHUTDOWN_DEADLINE_S)
    return _run_reporting_os_errors(lambda: run_process(agent))


def _run_reporting_os_errors(run: Callable[[], object]) -> int:
    """Run; an OSError (e.g. the metrics port is taken) is said plainly, exit status 1; a setting
    refused once the node is known (a ConfigError) exits 2 like any other bad setting."""
    failed: list[OSError] = []
    refused: list[ConfigError] = []
    try:
        run()
    except* ConfigError as group:
        # a setting that can only be judged once the node is known (e.g. spill vs host memory)
        refused.extend(e for e in group.exceptions if isinstance(e, ConfigError))
    except* OSError as group:
        failed.extend(e for e in group.exceptions if isinstance(e, OSError))
    for err in [*refused, *failed]:
        print(f"vgpu-agent: {err}", file=sys.stderr)
    return EXIT_CONFIG if refused else 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
