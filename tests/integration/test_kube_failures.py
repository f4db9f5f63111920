"""API failures: retried with backoff, never blocking callers; configuration without an API."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import subprocess
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from tests.fakes.kubeapi import NODE, Change, FakeKubeAPI, gpu, wired
from vgpu_agent.kube.backoff import Backoff, TokenBucket
from vgpu_agent.kube.node import KubeConfigError, NodeIntegration

UUID = "GPU-00000001-0000-0000-0000-000000000000"


def labels_of(api: FakeKubeAPI) -> dict[str, str]:
    labels: dict[str, str] = api.nodes[NODE]["metadata"].get("labels", {})
    return labels


# --- backoff (pure) ---------------------------------------------------------------------------


def test_backoff_doubles_up_to_the_cap_and_resets() -> None:
    backoff = Backoff(initial=0.5, cap=60, jitter=0.0)
    delays = [backoff.next_delay() for _ in range(10)]
    assert delays == [0.5, 1, 2, 4, 8, 16, 32, 60, 60, 60]
    backoff.reset()
    assert backoff.next_delay() == 0.5


def test_backoff_jitter_only_shortens() -> None:
    low = Backoff(initial=1, cap=8, jitter=0.5, rand=lambda: 0.999999)
    high = Backoff(initial=1, cap=8, jitter=0.5, rand=lambda: 0.0)
    assert [round(low.next_delay(), 3) for _ in range(5)] == [0.5, 1, 2, 4, 4]
    assert [high.next_delay() for _ in range(5)] == [1, 2, 4, 8, 8]


def test_backoff_survives_many_failures() -> None:
    backoff = Backoff(initial=0.5, cap=60, jitter=0.0)
    for _ in range(5000):
        delay = backoff.next_delay()
    assert delay == 60


@pytest.mark.parametrize(("initial", "cap", "jitter"), [(0, 1, 0), (2, 1, 0), (1, 2, 1.0)])
def test_backoff_rejects_bad_parameters(initial: float, cap: float, jitter: float) -> None:
    with pytest.raises(ValueError, match="backoff"):
        Backoff(initial, cap, jitter)


def test_token_bucket_allows_a_burst_then_the_rate() -> None:
    bucket = TokenBucket(rate=2.0, burst=3, now=100.0)
    assert [bucket.delay(100.0) for _ in range(3)] == [0, 0, 0]
    assert bucket.delay(100.0) == pytest.approx(0.5)
    assert bucket.delay(100.25) == pytest.approx(0.25)
    assert bucket.delay(100.5) == 0
    assert [bucket.delay(1000.0) for _ in range(4)][-1] == pytest.approx(0.5)  # refills to burst


@pytest.mark.parametrize(("rate", "burst"), [(0, 1), (1, 0), (-1, 5)])
def test_token_bucket_rejects_bad_parameters(rate: float, burst: int) -> None:
    with pytest.raises(ValueError, match="token bucket"):
        TokenBucket(rate, burst, now=0)


# --- failures of the API server ---------------------------------------------------------------


async def test_server_errors_are_retried_with_growing_delays(tmp_path: Path) -> None:
    async with wired(tmp_path) as w:
        w.api.fail(500, times=4, method="GET")
        with capture_logs() as logs:
            await w.node.publish_labels([gpu(0)], 4, "1")
            await w.api.wait_for(lambda: labels_of(w.api).get("vgpu.io/gpu.count") == "1")
        retries = [e for e in logs if e["event"] == "kube_api_retry"]
        assert [e["attempt"] for e in retries] == [1, 2, 3, 4]
        assert all("HTTP 500" in e["error"] for e in retries)
        # jitter shortens a delay to at most half, so each cap-free step still grows
        assert retries[0]["retry_in_s"] <= 0.02 < retries[2]["retry_in_s"] * 2


async def test_timeouts_are_retried(tmp_path: Path) -> None:
    async with wired(tmp_path, request_timeout=0.2) as w:
        w.api.stall(1.0, times=2, method="GET")
        with capture_logs() as logs:
            await w.node.publish_labels([gpu(0)], 4, "1")
            await w.api.wait_for(lambda: "vgpu.io/gpu.count" in labels_of(w.api), within=5)
        errors = [e["error"] for e in logs if e["event"] == "kube_api_retry"]
        assert errors[:2] == ["request timed out", "request timed out"]


async def test_unreachable_server_then_recovery(tmp_path: Path) -> None:
    async with wired(tmp_path) as w:
        await w.api.stop()  # connection refused from here on
        with capture_logs() as logs:
            await w.node.publish_labels([gpu(0), gpu(1)], 4, "1")
            w.node.on_health_change(Change(UUID, False, "XID critical error", 79))
            await asyncio.sleep(0.4)
        retries = [e for e in logs if e["event"] == "kube_api_retry"]
        assert {e["operation"] for e in retries} == {"node_labels", "gpu_health_event"}
        assert any("Connect" in e["error"] for e in retries)
        assert w.node.queued_events == 1

        await w.api.start()  # same port
        await w.api.wait_for(
            lambda: labels_of(w.api).get("vgpu.io/gpu.count") == "2" and w.api.all_events(),
            within=5,
        )


async def test_callers_never_wait_on_a_hung_api(tmp_path: Path) -> None:
    async with wired(tmp_path, request_timeout=5.0) as w:
        w.api.stall(3.0, times=10)
        await w.node.publish_labels([gpu(0)], 4, "1")
        await asyncio.sleep(0.05)  # the worker is now inside a hung request
        started = time.perf_counter()
        for n in range(100):
            await w.node.publish_labels([gpu(0)], n + 1, "1")
            w.node.on_health_change(Change(UUID, n % 2 == 0, "flap", None))
        assert time.perf_counter() - started < 0.05


async def test_event_queue_is_bounded_while_api_is_down(tmp_path: Path) -> None:
    api = FakeKubeAPI()
    await api.start()
    await api.stop()
    node = NodeIntegration(
        NODE,
        str(api.write_kubeconfig(tmp_path / "kubeconfig")),
        namespace="ns",
        backoff_initial=0.05,
        max_queued_events=3,
    )
    await node.start()
    with capture_logs() as logs:
        for n in range(5):
            node.on_health_change(Change(f"GPU-{n}", False, "lost", None))
    assert node.queued_events == 3
    assert [e["uuid"] for e in logs if e["event"] == "gpu_health_event_dropped"] == [
        "GPU-0",
        "GPU-1",
    ]
    await node.close()


@pytest.mark.parametrize("code", [401, 403, 404, 429, 503])
async def test_retryable_statuses_keep_the_labels_pending(tmp_path: Path, code: int) -> None:
    async with wired(tmp_path) as w:
        w.api.fail(code, times=2, method="GET")
        await w.node.publish_labels([gpu(0)], 4, "1")
        await w.api.wait_for(lambda: "vgpu.io/gpu.count" in labels_of(w.api))


async def test_missing_node_is_waited_for(tmp_path: Path) -> None:
    async with wired(tmp_path) as w:
        del w.api.nodes[NODE]
        await w.node.publish_labels([gpu(0)], 4, "1")
        await w.api.wait_for(lambda: sum(r.status == 404 for r in w.api.requests) >= 2)
        w.api.add_node(NODE, {"kubernetes.io/hostname": NODE})
        await w.api.wait_for(lambda: "vgpu.io/gpu.count" in labels_of(w.api))


async def test_wrong_token_is_retried_not_dropped(tmp_path: Path) -> None:
    async with wired(tmp_path) as w:
        w.api.token = "rotated"
        with capture_logs() as logs:
            await w.node.publish_labels([gpu(0)], 4, "1")
            await w.api.wait_for(lambda: sum(r.status == 401 for r in w.api.requests) >= 2)
        assert any("HTTP 401" in e.get("error", "") for e in logs)
        assert "vgpu.io/gpu.count" not in labels_of(w.api)


async def test_rejected_labels_are_dropped_not_retried_forever(tmp_path: Path) -> None:
    async with wired(tmp_path) as w:
        w.api.fail(422, method="PATCH")
        with capture_logs() as logs:
            await w.node.publish_labels([gpu(0)], 4, "1")
            await w.api.wait_for(lambda: any(r.status == 422 for r in w.api.requests))
            await asyncio.sleep(0.2)
        assert [e["event"] for e in logs if "labels" in e["event"]] == ["node_labels_rejected"]
        assert sum(r.method == "PATCH" for r in w.api.requests) == 1
        # a later publish is tried again
        await w.node.publish_labels([gpu(0)], 4, "1")
        await w.api.wait_for(lambda: "vgpu.io/gpu.count" in labels_of(w.api))


# --- configuration ------------------------------------------------------------------------------


async def test_without_api_config_it_says_so_once_and_does_nothing() -> None:
    node = NodeIntegration(NODE, None, environ={})
    with capture_logs() as logs:
        task = asyncio.create_task(node.run())
        await asyncio.sleep(0.05)
        await node.publish_labels([gpu(0)], 4, "1")
        node.on_health_change(Change(UUID, False, "lost", None))
        await asyncio.sleep(0.05)
        assert not task.done(), "run() must stay up until cancelled"
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert [e["event"] for e in logs] == ["kube_api_disabled"]
    assert not node.enabled and node.queued_events == 0


async def test_explicit_in_cluster_false_disables_even_inside_a_pod() -> None:
    node = NodeIntegration(NODE, None, in_cluster=False, environ={"KUBERNETES_SERVICE_HOST": "x"})
    await node.start()
    assert not node.enabled


async def test_unreadable_kubeconfig_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-kubeconfig"
    with pytest.raises(KubeConfigError, match=f"cannot load kubeconfig {missing}"):
        await NodeIntegration(NODE, str(missing)).start()
    broken = tmp_path / "broken"
    broken.write_text("clusters: [this is not: a kubeconfig")
    with pytest.raises(KubeConfigError, match=f"kubeconfig {broken}"):
        await NodeIntegration(NODE, str(broken)).start()


async def test_in_cluster_without_service_account(tmp_path: Path) -> None:
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    with capture_logs() as logs:
        auto = NodeIntegration(NODE, None, environ=env, service_account_dir=tmp_path)
        await auto.start()
    assert not auto.enabled
    assert logs[0]["event"] == "kube_api_disabled" and "token" in logs[0]["reason"]
    with pytest.raises(KubeConfigError, match="cannot load in-cluster configuration"):
        await NodeIntegration(
            NODE, None, in_cluster=True, environ=env, service_account_dir=tmp_path
        ).start()


def test_empty_node_name_is_rejected() -> None:
    with pytest.raises(ValueError, match="node_name is empty"):
        NodeIntegration("", None)


def test_bad_pacing_parameters_are_rejected_at_construction() -> None:
    with pytest.raises(ValueError, match="token bucket"):
        NodeIntegration(NODE, None, events_per_second=0)
    with pytest.raises(ValueError, match="backoff"):
        NodeIntegration(NODE, None, backoff_initial=5, backoff_cap=1)


@pytest.fixture
def service_account(tmp_path: Path) -> tuple[Path, Path]:
    """A service account dir (self-signed CA for 127.0.0.1, token, namespace) and the key."""
    sa = tmp_path / "sa"
    sa.mkdir()
    key = tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-subj", "/CN=kubernetes", "-addext", "subjectAltName=IP:127.0.0.1",
            "-keyout", str(key), "-out", str(sa / "ca.crt"),
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    (sa / "token").write_text("sa-token")
    (sa / "namespace").write_text("gpu-operators\n")
    return sa, key


async def test_in_cluster_over_tls_with_service_account(
    service_account: tuple[Path, Path],
) -> None:
    """The in-cluster path: HTTPS with the service account's CA, token and namespace."""
    sa, key = service_account
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(sa / "ca.crt", key)
    api = FakeKubeAPI(token="sa-token", ssl_context=context)
    await api.start()
    api.add_node(NODE)
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(api.port)}
    node = NodeIntegration(NODE, None, environ=env, service_account_dir=sa, backoff_initial=0.02)
    task = asyncio.create_task(node.run())
    try:
        await node.publish_labels([gpu(0)], 4, "1")
        node.on_health_change(Change(UUID, False, "lost", None))
        await api.wait_for(lambda: "vgpu.io/gpu.count" in labels_of(api) and api.all_events())
        assert list(api.events) == ["gpu-operators"]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await api.stop()
