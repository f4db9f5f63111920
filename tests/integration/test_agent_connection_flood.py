"""1,000 half-sent HTTP requests to `vgpu-agent run` under `ulimit -n 1024`: Allocate and
/healthz keep working.

The agent runs as its own process with soft and hard RLIMIT_NOFILE at 1024 (what containers
often get; it cannot raise the soft limit past the hard one), registered with a kubelet stand-in
in this process. The attack comes from worker threads so the stand-in keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys

from tests.integration.hostile_clients import close_all, get, open_half_requests
from tests.integration.plugin_harness import RESOURCE, short_dir
from vgpu_agent.kubelet.standin import KubeletStandIn

NOFILE = 1024


class AgentProcess:
    """`vgpu-agent run` on simulated GPUs; its JSON log is collected as it is written."""

    def __init__(self, root) -> None:  # type: ignore[no-untyped-def]
        self.root = root
        self.events: list[dict] = []
        self.raw: list[str] = []
        self.proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None

    async def start(self, extra_env: dict[str, str] | None = None) -> None:
        # `ulimit -n` in a shell that then becomes the agent: no preexec_fn, which would fork a
        # process whose gRPC threads are busy
        self.proc = await asyncio.create_subprocess_exec(
            "sh", "-c", f'ulimit -n {NOFILE} && exec "$@"', "sh",
            sys.executable, "-m", "vgpu_agent.cli", "run", "--backend", "sim",
            "--sim-gpus", "2xA100-80GB", "--split-count", "64",
            "--device-plugin-dir", str(self.root / "dp"), "--state-dir", str(self.root / "state"),
            "--pod-resources-socket", str(self.root / "pr.sock"),
            "--metrics-address", "127.0.0.1:0",
            env={**os.environ, **(extra_env or {})},
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        )
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        while line := await self.proc.stderr.readline():
            text = line.decode(errors="replace").rstrip("\n")
            self.raw.append(text)
            with contextlib.suppress(ValueError):  # a line that is not JSON stays in `raw`
                self.events.append(json.loads(text))

    def event(self, name: str) -> dict | None:
        return next((e for e in self.events if e.get("event") == name), None)

    async def port(self) -> int:
        for _ in range(300):
            serving = self.event("metrics_serving")
            if serving is not None:
                return int(serving["url"].rsplit(":", 1)[1].split("/")[0])
            await asyncio.sleep(0.05)
        raise AssertionError("the agent never served metrics: " + "\n".join(self.raw[-20:]))

    def open_descriptors(self) -> int:
        assert self.proc is not None
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def cpu_seconds(self) -> float:
        """User and system CPU the agent has used so far."""
        assert self.proc is not None
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    async def stop(self) -> int:
        assert self.proc is not None
        if self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        if self._reader is not None:
            await self._reader
        return self.proc.returncode or 0


async def test_a_thousand_half_open_connections_leave_allocate_and_healthz_working():
    with short_dir() as root:
        os.makedirs(root / "dp")
        kubelet = KubeletStandIn(str(root / "dp"))
        await kubelet.start()
        agent = AgentProcess(root)
        await agent.start()
        held: list = []
        try:
            port = await agent.port()
            await kubelet.wait_for(lambda: RESOURCE in kubelet.resources, limit_s=30)
            limits = agent.event("open_files_limit")
            assert limits == {**limits, "soft": NOFILE, "hard": NOFILE}

            held = await asyncio.to_thread(open_half_requests, "127.0.0.1", port, 1000)
            assert len(held) >= 900  # accepted (and mostly displaced later), not refused
            assert agent.open_descriptors() < 400

            for n in range(20):  # Allocate needs descriptors: regions, spares, gRPC
                admission = await asyncio.wait_for(
                    kubelet.admit("ns", f"pod-{n}", "main", RESOURCE, 2), 10
                )
                assert admission.response.envs["NVIDIA_VISIBLE_DEVICES"]
                status, took = await asyncio.to_thread(get, f"http://127.0.0.1:{port}/healthz")
                assert status == 200 and took < 2.0
            more = await asyncio.to_thread(open_half_requests, "127.0.0.1", port, 500)
            held += more
            status, _ = await asyncio.to_thread(get, f"http://127.0.0.1:{port}/metrics")
            assert status == 200
        finally:
            close_all(held)
            code = await agent.stop()
            await kubelet.stop()
        assert code == 0
        log = "\n".join(agent.raw)
        assert "Too many open files" not in log
        assert "Traceback" not in log
        limited = [e for e in agent.events if e.get("event") == "metrics_connections_limited"]
        assert 1 <= len(limited) <= 2  # said once (a minute), not once per connection
