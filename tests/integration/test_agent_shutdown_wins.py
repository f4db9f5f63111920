"""Shutdown always wins: whatever fails on the way out, SIGTERM ends the agent, status 0, in 5 s.

The failures are real: a plugin socket that cannot be removed (a file where its directory was),
a task that raises while it is being cancelled, a GPU backend whose shutdown hangs.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import textwrap
import time

import pytest
from structlog.testing import capture_logs

from tests.integration.plugin_harness import RESOURCE, config_for, short_dir
from vgpu_agent.agent import Agent
from vgpu_agent.kubelet.standin import KubeletStandIn


@pytest.fixture
def root():
    with short_dir() as path:
        yield path


def json_lines(stderr: bytes) -> list[dict]:
    """Every line the agent wrote, each parsed as JSON (a raw traceback would fail here)."""
    return [json.loads(line) for line in stderr.decode().splitlines() if line.strip()]


async def test_sigterm_with_an_unremovable_plugin_socket_exits_0_within_5_s(root):
    os.makedirs(root / "dp")
    kubelet = KubeletStandIn(str(root / "dp"))
    await kubelet.start()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "vgpu_agent.cli", "run", "--backend", "sim",
        "--device-plugin-dir", str(root / "dp"), "--state-dir", str(root / "state"),
        "--pod-resources-socket", str(root / "pr.sock"), "--metrics-address", "127.0.0.1:0",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        await kubelet.wait_for(lambda: RESOURCE in kubelet.resources, limit_s=30)
        # The directory goes and a file takes its place: unlink(dp/vgpu-agent.sock) now fails
        # with ENOTDIR, on the agent's way out as on any restart of the plugin.
        os.rename(root / "dp", root / "dp.gone")
        (root / "dp").write_text("not a directory")
        await asyncio.sleep(0.5)  # the plugin notices its socket gone
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        _, stderr = await asyncio.wait_for(proc.communicate(), 10)
        took = time.monotonic() - started
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        if (root / "dp.gone").exists():
            os.unlink(root / "dp")
            os.rename(root / "dp.gone", root / "dp")
        await kubelet.stop()
    assert proc.returncode == 0
    assert took < 5.0
    events = json_lines(stderr)
    names = [e["event"] for e in events]
    assert "plugin_socket_remove_failed" in names
    failed = next(e for e in events if e["event"] == "plugin_socket_remove_failed")
    assert "Not a directory" in failed["error"]
    assert names[-1] == "agent_stopped"
    assert not [e for e in events if e["event"] == "task_failed"]  # never restarted


async def test_a_task_failing_while_cancelled_is_not_restarted(root):
    agent = Agent(config_for(root))
    calls = 0

    async def fails_on_the_way_out() -> None:
        nonlocal calls
        calls += 1
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise OSError(30, "Read-only file system") from None

    async def group_run() -> None:
        async with asyncio.TaskGroup() as group:
            agent._supervise(group, "fragile", fails_on_the_way_out)

    with capture_logs() as logs:
        task = asyncio.create_task(group_run())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 2)
    assert calls == 1
    assert agent.tasks.restarts == {}
    stopping = [e for e in logs if e["event"] == "task_failed_while_stopping"]
    assert stopping and "Read-only file system" in stopping[0]["error"]


async def test_a_task_that_fails_is_restarted_with_backoff_and_said_each_time(root):
    agent = Agent(config_for(root))
    calls: list[float] = []

    async def fails_twice() -> None:
        calls.append(time.monotonic())
        if len(calls) <= 2:
            raise ConnectionResetError(104, "Connection reset by peer")
        # the third run works, and ends by itself

    async def group_run() -> None:
        async with asyncio.TaskGroup() as group:
            agent._supervise(group, "flaky", fails_twice)

    with capture_logs() as logs:
        await asyncio.wait_for(group_run(), 10)
    assert len(calls) == 3
    assert agent.tasks.restarts == {"flaky": 2}
    assert "flaky" not in agent.tasks.running
    failed = [e for e in logs if e["event"] == "task_failed"]
    # each failure logged with its traceback and when the task comes back: 0.5 s, then 1 s
    assert [(e["task"], e["restart_in_s"]) for e in failed] == [("flaky", 0.5), ("flaky", 1.0)]
    assert all(e["log_level"] == "error" and e.get("exc_info") for e in failed)
    assert calls[1] - calls[0] >= 0.5 - 0.05 and calls[2] - calls[1] >= 1.0 - 0.05
    assert [e["task"] for e in logs if e["event"] == "task_finished"] == ["flaky"]


async def test_a_hanging_shutdown_step_still_ends_the_process_with_0(root):
    script = textwrap.dedent(
        """
        import asyncio, os, signal, sys, time
        from pathlib import Path
        from tests.integration.plugin_harness import config_for
        from vgpu_agent.agent import Agent
        from vgpu_agent.gpu.sim import SimBackend
        from vgpu_agent.logging import configure

        class HangingShutdown(SimBackend):
            def shutdown(self):
                time.sleep(60)

        async def main():
            configure("json")
            agent = Agent(config_for(Path(sys.argv[1])), backend=HangingShutdown("1xA100-80GB"),
                          exit_process_after_s=1.0)

            async def stop_when_ready():
                await agent.ready.wait()
                os.kill(os.getpid(), signal.SIGTERM)

            stopper = asyncio.create_task(stop_when_ready())
            await agent.run()
            del stopper

        asyncio.run(main())
        """
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, str(root),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        _, stderr = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, stderr.decode()[-2000:]
    events = json_lines(stderr)
    names = [e["event"] for e in events]
    assert "signal_received" in names
    assert names[-1] == "shutdown_deadline_exceeded"
    signalled = next(e for e in events if e["event"] == "signal_received")["timestamp"]
    deadline = events[-1]["timestamp"]
    assert signalled < deadline
