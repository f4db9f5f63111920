"""/readyz says "not ok" while regions cannot be created, and "ok" again once they can."""

from __future__ import annotations

import asyncio
import os
import urllib.error
import urllib.request

import grpc
import pytest

from tests.integration.hostile_clients import get
from tests.integration.plugin_harness import RESOURCE, config_for, running_agent, short_dir


@pytest.fixture
def root():
    with short_dir() as path:
        yield path


async def readyz(port: int) -> tuple[int, str]:
    def fetch() -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    return await asyncio.to_thread(fetch)


async def test_readyz_follows_whether_regions_can_be_created(root):
    async with running_agent(config_for(root)) as run:
        port = run.agent.metrics.port
        await run.kubelet.wait_for(
            lambda: run.agent.runner is not None and run.agent.runner.status.registered, 10
        )
        await asyncio.sleep(0.3)  # the spares made at start are done
        assert (await readyz(port))[0] == 200

        regions = root / "state" / "regions"
        os.rename(regions, root / "state" / "regions.away")
        regions.write_text("the disk went read-only, or someone put a file here")
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await run.kubelet.admit("ns", "p1", "main", RESOURCE, 1)
        assert failed.value.code() == grpc.StatusCode.INTERNAL
        status, body = await readyz(port)
        assert status == 503
        assert "allocate: regions cannot be created" in body and str(regions) in body
        assert (await asyncio.to_thread(get, f"http://127.0.0.1:{port}/healthz"))[0] == 200

        regions.unlink()
        os.rename(root / "state" / "regions.away", regions)
        run.kubelet.admissions.clear()
        await run.kubelet.admit("ns", "p2", "main", RESOURCE, 1)
        assert (await readyz(port))[0] == 200
