"""At start the agent raises its soft open-files limit to the hard one and logs both."""

from __future__ import annotations

import resource

from structlog.testing import capture_logs

from vgpu_agent.agent import raise_open_files_limit


def test_the_soft_limit_goes_up_to_the_hard_limit_and_both_are_logged():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowered = 256
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
    try:
        with capture_logs() as logs:
            raise_open_files_limit()
        now_soft, now_hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        assert now_hard == hard
        assert now_soft == (hard if hard != resource.RLIM_INFINITY else max(lowered, 1 << 20))
        (event,) = [e for e in logs if e["event"] == "open_files_limit"]
        assert event["soft_before"] == lowered and event["soft"] == now_soft
        assert event["hard"] == hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
