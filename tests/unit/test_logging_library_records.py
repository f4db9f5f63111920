"""Standard-library log records (grpc, asyncio, aiohttp) come out as one JSON event each."""

from __future__ import annotations

import io
import json
import logging

from vgpu_agent.logging import _ToStructlog, configure


def test_a_library_exception_is_one_json_line_without_a_traceback():
    stream = io.StringIO()
    root = logging.getLogger()
    before = list(root.handlers)
    try:
        configure("json", stream=stream)
        configure("json", stream=stream)  # configured twice: still one handler
        assert sum(isinstance(h, _ToStructlog) for h in root.handlers) == 1
        try:
            raise ConnectionResetError("peer went away")
        except ConnectionResetError:
            logging.getLogger("aiohttp.server").exception("Error handling request")
        logging.getLogger("grpc").info("below WARNING: not routed")
    finally:
        root.handlers = before
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    event = json.loads(lines[0])
    assert event["event"] == "library_log" and event["logger"] == "aiohttp.server"
    assert event["message"] == "Error handling request"
    assert "peer went away" in event["error"]
    assert "Traceback" not in stream.getvalue()
