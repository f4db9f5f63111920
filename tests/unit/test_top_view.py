"""`vgpu-agent top` as a client: the frame it prints for a fixed status (golden text, no colours),
what stands out, and its error paths."""

from __future__ import annotations

import copy
import io
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests.integration.test_prometheus_scrape import free_port
from vgpu_agent.cli import main
from vgpu_agent.top import TopError, fetch_status, frame_text, run_top, status_url

GIB = 1024**3

STATUS: dict[str, Any] = {
    "schema_version": 1,
    "node": "node-a",
    "agent_version": "0.1.0",
    "generated_at": 1_800_000_000.0,
    "registered": True,
    "gpus": [
        {"uuid": "GPU-aaaa", "index": 0, "model": "NVIDIA A100-80GB",
         "memory_total_bytes": 80 * GIB, "memory_used_bytes": 30 * GIB,
         "utilization_ratio": 0.52, "healthy": True, "readings_stale": False,
         "slices_total": 4, "slices_allocated": 2},
        {"uuid": "GPU-bbbb", "index": 1, "model": "NVIDIA L4-24GB",
         "memory_total_bytes": 24 * GIB, "memory_used_bytes": None,
         "utilization_ratio": None, "healthy": False, "readings_stale": True,
         "slices_total": 4, "slices_allocated": 0},
    ],
    "allocations": [
        {"alloc_id": "000000000001-aa", "seq": 1, "namespace": "prod", "pod": "infer-0",
         "container": "main", "state": "active", "priority": 10, "error": None,
         "devices": [{"gpu_uuid": "GPU-aaaa", "gpu_index": 0,
                      "memory_limit_bytes": 20 * GIB, "memory_used_bytes": 12 * GIB,
                      "core_limit_ratio": 0.25, "core_target_ratio": 0.25,
                      "core_measured_ratio": 0.239, "policy": "strict",
                      "rate_limited": True, "open_loop": False, "token_wait_seconds": 1.25,
                      "launches": 1000, "last_launch_age_seconds": 0.1}]},
        {"alloc_id": "000000000002-bb", "seq": 2, "namespace": "batch", "pod": "train-7",
         "container": "worker", "state": "active", "priority": 0, "error": None,
         "devices": [{"gpu_uuid": "GPU-aaaa", "gpu_index": 0,
                      "memory_limit_bytes": 20 * GIB, "memory_used_bytes": 21 * GIB,
                      "core_limit_ratio": 0.25, "core_target_ratio": 0.4,
                      "core_measured_ratio": 0.41, "policy": "work-conserving",
                      "rate_limited": False, "open_loop": False, "token_wait_seconds": 90.0,
                      "launches": 5, "last_launch_age_seconds": 4000.0}]},
        {"alloc_id": "000000000003-cc", "seq": 3, "namespace": None, "pod": None,
         "container": None, "state": "unidentified", "priority": 0, "error": None,
         "devices": [{"gpu_uuid": "GPU-gone", "gpu_index": None,
                      "memory_limit_bytes": 0, "memory_used_bytes": None,
                      "core_limit_ratio": 1.0, "core_target_ratio": None,
                      "core_measured_ratio": None, "policy": "off",
                      "rate_limited": None, "open_loop": None, "token_wait_seconds": None,
                      "launches": None, "last_launch_age_seconds": None}]},
    ],
}

GOLDEN = """\
vgpu-agent 0.1.0 on node-a: 2 GPUs, 3 allocations, registered

GPU 0 NVIDIA A100-80GB GPU-aaaa  healthy  util 52.0%  memory 30.0/80.0 GiB  slices 2/4
CONTAINER                MEMORY used/limit          SHARE measured     LIMIT   TARGET   WAITED   POLICY            PRIO   LAST
──────────────────────────────────────────────────────────────────────────────────────────────────────────────────────────────
prod/infer-0/main        ██████░░░░ 12.0/20.0 GiB   ██████████ 23.9%   25.0%    25.0%     1.2s   strict              10   0.1s
! batch/train-7/worker   ██████████ 21.0/20.0 GiB   ██████████ 41.0%   25.0%    40.0%     1.5m   work-conserving      0   1.1h

GPU 1 NVIDIA L4-24GB GPU-bbbb  UNHEALTHY  util - (stale)  memory ?/24.0 GiB  slices 0/4
CONTAINER                MEMORY used/limit   SHARE measured   LIMIT   TARGET   WAITED   POLICY   PRIO   LAST
────────────────────────────────────────────────────────────────────────────────────────────────────────────
(no allocations)

GPUs not on this node
CONTAINER                MEMORY used/limit      SHARE measured    LIMIT   TARGET   WAITED   POLICY   PRIO   LAST
────────────────────────────────────────────────────────────────────────────────────────────────────────────────
(000000000003-cc)        ·········· ?/inf GiB   ·········· -     100.0%        -        -   off         0      -
[unidentified]
"""


def _plain(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.splitlines()) + "\n"


def test_one_frame_for_a_fixed_status_matches_the_golden_text() -> None:
    assert _plain(frame_text(STATUS)) == GOLDEN


def test_a_container_above_its_limit_is_marked_and_one_within_is_not() -> None:
    lines = frame_text(STATUS).splitlines()
    assert any(line.startswith("! batch/train-7/worker") for line in lines)
    assert any(line.startswith("prod/infer-0/main") for line in lines)
    within = copy.deepcopy(STATUS)
    device = within["allocations"][1]["devices"][0]
    device["memory_used_bytes"] = 19 * GIB
    device["core_measured_ratio"] = 0.26  # a point above: NVML noise, not a breach
    device["core_target_ratio"] = 0.25
    assert "!" not in frame_text(within)


def test_a_work_conserving_container_on_lent_compute_is_not_marked() -> None:
    lending = copy.deepcopy(STATUS)
    device = lending["allocations"][1]["devices"][0]
    device["memory_used_bytes"] = 19 * GIB
    device["core_limit_ratio"], device["core_target_ratio"] = 0.25, 0.75
    device["core_measured_ratio"] = 0.72  # above its limit, within what it is lent
    assert "!" not in frame_text(lending)
    device["core_measured_ratio"] = 0.80  # above what the controller allows it now
    assert any(line.startswith("! batch/train-7/worker") for line in frame_text(lending).splitlines())


def test_spilled_memory_is_shown_after_the_memory_used() -> None:
    spilling = copy.deepcopy(STATUS)
    spilling["allocations"][0]["devices"][0]["memory_spilled_bytes"] = 3 * GIB
    spilling["allocations"][1]["devices"][0]["memory_spilled_bytes"] = 0
    lines = frame_text(spilling).splitlines()
    (infer,) = [line for line in lines if line.startswith("prod/infer-0/main")]
    assert "12.0/20.0 GiB (3.0 spilled)" in infer
    (train,) = [line for line in lines if "batch/train-7/worker" in line]
    assert "spilled" not in train


@pytest.mark.parametrize(
    ("typed", "expected"),
    [
        ("127.0.0.1:9394", "http://127.0.0.1:9394/status"),
        ("http://node:9394/", "http://node:9394/status"),
        ("http://node:9394/status", "http://node:9394/status"),
        ("https://proxy/agents/n1/status?x=1", "https://proxy/agents/n1/status?x=1"),
    ],
)
def test_status_url_accepts_a_base_url_or_the_full_one(typed: str, expected: str) -> None:
    assert status_url(typed) == expected


def test_status_url_refuses_other_schemes() -> None:
    with pytest.raises(TopError, match="ftp://x"):
        status_url("ftp://x")


class _Handler(BaseHTTPRequestHandler):
    body = b""
    code = 200

    def do_GET(self) -> None:
        self.send_response(self.code)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[tuple[str, type[_Handler]]]:
    handler = type("Handler", (_Handler,), {"body": json.dumps(STATUS).encode(), "code": 200})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", handler
    httpd.shutdown()
    httpd.server_close()


def test_once_prints_one_frame_from_the_endpoint(server: tuple[str, type[_Handler]]) -> None:
    url, _ = server
    out = io.StringIO()
    assert run_top(url, once=True, out=out) == 0
    assert _plain(out.getvalue()) == GOLDEN


def test_json_prints_the_raw_document(server: tuple[str, type[_Handler]]) -> None:
    url, _ = server
    out = io.StringIO()
    assert run_top(url, as_json=True, out=out) == 0
    assert json.loads(out.getvalue()) == STATUS


def test_an_unreachable_agent_is_one_line_naming_the_url_and_exit_1(
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = f"http://127.0.0.1:{free_port()}/status"
    assert main(["top", "--once", "--url", url]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("vgpu-agent top: cannot reach " + url)


def test_an_answer_that_is_not_a_status_is_refused_with_its_version(
    server: tuple[str, type[_Handler]],
) -> None:
    url, handler = server
    handler.body = json.dumps({"schema_version": 7}).encode()
    with pytest.raises(TopError, match="schema_version 7: this client reads 1"):
        fetch_status(url + "/status")
    handler.body = b"<html>not json</html>"
    with pytest.raises(TopError, match="did not answer with a JSON status document"):
        fetch_status(url + "/status")
    handler.code = 503
    with pytest.raises(TopError, match="HTTP 503"):
        fetch_status(url + "/status")


def test_the_live_view_keeps_the_last_status_when_the_agent_goes_away() -> None:
    answers: list[dict[str, Any] | TopError] = [STATUS, TopError("cannot reach x: refused")]
    calls: list[str] = []

    def fetch(url: str) -> dict[str, Any]:
        calls.append(url)
        answer = answers.pop(0)
        if isinstance(answer, TopError):
            raise answer
        return answer

    out = io.StringIO()
    code = run_top("127.0.0.1:1", interval_s=0.1, out=out, fetch=fetch, sleep=lambda s: None,
                   frames=2)
    assert code == 0
    text = out.getvalue()
    assert calls == ["http://127.0.0.1:1/status"] * 2
    assert text.count("GPU 0 NVIDIA A100-80GB") == 2  # the second frame repeats the last status
    assert "cannot reach x: refused (showing the last status)" in text


def test_interval_out_of_range_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["top", "--interval", "0"])
    assert exit_info.value.code == 2
    assert "'0' is not allowed: seconds in 0.1..3600" in capsys.readouterr().err


def test_a_gpu_read_as_time_sliced_says_its_use_is_estimated() -> None:
    sliced = copy.deepcopy(STATUS)
    sliced["gpus"][0]["nvml_time_sliced"] = True
    sliced["gpus"][1]["nvml_time_sliced"] = False
    sliced["gpus"][0]["uncharged_use_ratio"] = 0.425
    lines = [line for line in frame_text(sliced).splitlines() if line.startswith("GPU ")]
    assert "NVML time-sliced (use estimated)" in lines[0]
    assert "busy beyond the work 42" in lines[0]
    assert "time-sliced" not in lines[1] and "beyond" not in lines[1]


def test_a_gpu_whose_use_goes_only_to_strangers_says_its_containers_are_unmeasured() -> None:
    status = copy.deepcopy(STATUS)
    status["gpus"][0]["nvml_use_only_strangers"] = True
    status["gpus"][1]["nvml_use_only_strangers"] = False
    lines = [line for line in frame_text(status).splitlines() if line.startswith("GPU ")]
    assert "use only by processes of no container (unmeasured)" in lines[0]
    assert "no container" not in lines[1]
    # an older agent's /status has no such field: nothing said
    assert "no container" not in frame_text(STATUS)


def test_a_container_paused_for_a_neighbours_turn_alone_is_marked() -> None:
    turning = copy.deepcopy(STATUS)
    turning["allocations"][0]["devices"][0]["paused"] = True
    turning["allocations"][1]["devices"][0]["paused"] = False
    text = frame_text(turning)
    lines = text.splitlines()
    (at,) = [n for n, line in enumerate(lines) if line.startswith("prod/infer-0/main")]
    # the name column folds: the mark follows the container's name, on its row or the next
    assert "[paused: turn alone]" in " ".join(lines[at : at + 2])
    assert text.count("paused") == 1  # not the other, nor a status without the field
    assert "paused" not in frame_text(STATUS)
