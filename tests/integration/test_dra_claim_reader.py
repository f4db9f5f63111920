"""Reading ResourceClaims through kubernetes_asyncio from the fake API server, and each failure
turned into the message the kubelet shows for that claim."""

from __future__ import annotations

import pytest

from tests.fakes.kubeapi import FakeKubeAPI
from vgpu_agent.dra.claims import ClaimReader, ClaimReadError

BODY = {
    "metadata": {"name": "train"},
    "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "x.io"}}]}},
}


@pytest.fixture
async def api():
    fake = FakeKubeAPI()
    await fake.start()
    yield fake
    await fake.stop()


async def reader_for(api, tmp_path, **options):
    reader = ClaimReader(str(api.write_kubeconfig(tmp_path / "kubeconfig")), **options)
    await reader.start()
    return reader


async def test_reads_the_stored_claim_with_its_uid_and_status(api, tmp_path):
    created = api.resources.create("resourceclaims", "team-a", BODY)
    reader = await reader_for(api, tmp_path)
    try:
        claim = await reader.read("team-a", "train")
    finally:
        await reader.close()
    assert claim["metadata"]["uid"] == created["metadata"]["uid"]
    assert claim["kind"] == "ResourceClaim"
    (request,) = [r for r in api.requests if "resourceclaims" in r.path]
    assert (request.method, request.path) == (
        "GET",
        "/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaims/train",
    )


async def test_a_deleted_claim_says_so(api, tmp_path):
    api.resources.create("resourceclaims", "team-a", BODY)
    api.resources.delete("resourceclaims", "team-a", "train")
    reader = await reader_for(api, tmp_path)
    try:
        with pytest.raises(ClaimReadError, match="team-a/train not found: deleted"):
            await reader.read("team-a", "train")
    finally:
        await reader.close()


async def test_forbidden_and_server_errors_name_the_status(api, tmp_path):
    api.resources.create("resourceclaims", "team-a", BODY)
    reader = await reader_for(api, tmp_path)
    try:
        api.fail(403, method="GET", path="resourceclaims")
        with pytest.raises(ClaimReadError, match="HTTP 403"):
            await reader.read("team-a", "train")
        api.fail(500, method="GET", path="resourceclaims")
        with pytest.raises(ClaimReadError, match="HTTP 500"):
            await reader.read("team-a", "train")
        assert (await reader.read("team-a", "train"))["metadata"]["name"] == "train"
    finally:
        await reader.close()


async def test_an_unreachable_or_slow_api_is_a_retryable_claim_error(api, tmp_path):
    api.resources.create("resourceclaims", "team-a", BODY)
    reader = await reader_for(api, tmp_path, request_timeout=0.3)
    try:
        api.stall(2.0, method="GET", path="resourceclaims")
        with pytest.raises(ClaimReadError, match=r"unreachable.*timed out.*the kubelet retries"):
            await reader.read("team-a", "train")
        await api.stop()
        with pytest.raises(ClaimReadError, match="unreachable"):
            await reader.read("team-a", "train")
        await api.start()  # the same port again: the next call succeeds
        assert (await reader.read("team-a", "train"))["metadata"]["name"] == "train"
    finally:
        await reader.close()


async def test_no_configuration_is_refused_at_start(tmp_path):
    reader = ClaimReader(None, environ={})
    with pytest.raises(ClaimReadError, match="no Kubernetes API configuration"):
        await reader.start()
    broken = ClaimReader(str(tmp_path / "missing-kubeconfig"), environ={})
    with pytest.raises(ClaimReadError, match="cannot load"):
        await broken.start()
