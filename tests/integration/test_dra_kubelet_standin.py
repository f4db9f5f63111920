"""The kubelet DRA stand-in's plugin watcher checks what a plugin says about itself, as the
kubelet does, and tells the plugin why it refused it."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from tests.integration.plugin_harness import short_dir
from vgpu_agent._proto.pluginregistration.v1 import api_pb2 as reg
from vgpu_agent._proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from vgpu_agent.kubelet.drastandin import DraKubeletStandIn


class Plugin(reg_grpc.RegistrationServicer):
    def __init__(self, info: reg.PluginInfo):
        self.info = info
        self.verdicts: list[reg.RegistrationStatus] = []
        self.told = asyncio.Event()

    async def GetInfo(self, request, context):
        return self.info

    async def NotifyRegistrationStatus(self, request, context):
        self.verdicts.append(request)
        self.told.set()
        return reg.RegistrationStatusResponse()


@contextlib.asynccontextmanager
async def serving(path, servicer):
    server = grpc.aio.server()
    reg_grpc.add_RegistrationServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix:{path}")
    await server.start()
    try:
        yield
    finally:
        await server.stop(0)


@pytest.mark.parametrize(
    ("info", "reason"),
    [
        (dict(type="CSIPlugin"), "plugin type 'CSIPlugin' is not handled"),
        (dict(name="GPU_Driver"), "is not a DNS subdomain"),
        (dict(supported_versions=["v2.DRAPlugin"]), "none of the versions ['v2.DRAPlugin']"),
        (dict(endpoint="relative.sock"), "is not an absolute socket path"),
        (dict(), "cannot connect to endpoint"),  # nothing serves the endpoint
    ],
)
async def test_refusals_are_told_to_the_plugin_with_the_reason(info, reason):
    with short_dir() as root:
        values = dict(
            type="DRAPlugin",
            name="gpu.vgpu.io",
            endpoint=str(root / "nothing.sock"),
            supported_versions=["v1.DRAPlugin"],
        )
        values.update(info)
        plugin = Plugin(reg.PluginInfo(**values))
        kubelet = DraKubeletStandIn(str(root / "registry"))
        (root / "registry").mkdir()
        async with serving(root / "registry" / "p-reg.sock", plugin):
            await kubelet.start()
            try:
                await asyncio.wait_for(plugin.told.wait(), 10)
            finally:
                await kubelet.stop()
        (verdict,) = plugin.verdicts
        assert not verdict.plugin_registered
        assert reason in verdict.error
        assert kubelet.plugins == {}
        assert kubelet.rejected[0][1] == verdict.error
