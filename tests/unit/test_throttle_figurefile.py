"""The file that keeps what containers alone showed on time-sliced GPUs across agent restarts
(`throttle/figurefile.py`): round trip, and every way it can be unusable."""

from __future__ import annotations

import json
import re

import pytest
import structlog

from vgpu_agent.throttle import figurefile
from vgpu_agent.throttle.figurefile import FigureFile, FigureFileError, decode, encode

GPU = "GPU-5a11ce00-0000-4000-8000-000000000001"


def test_figures_come_back_as_they_were_saved(tmp_path):
    store = FigureFile(tmp_path / figurefile.FILE_NAME)
    figures = {GPU: {"a": (1.5e-8, 2.0e9), "b": (3.0e-8, 1.0e9)}, "GPU-other": {"c": (2.0, 5.0)}}
    store.save(figures)
    assert store.load() == figures
    assert not list(tmp_path.glob(".*.tmp"))  # replaced through a temp file, none left


def test_a_gpu_without_figures_is_not_written():
    assert json.loads(encode({GPU: {}, "GPU-other": {"c": (2.0, 5.0)}}))["gpus"] == {
        "GPU-other": {"c": [2.0, 5.0]}}


def test_no_file_is_no_figures(tmp_path):
    assert FigureFile(tmp_path / "none.json").load() == {}


@pytest.mark.parametrize(("text", "why"), [
    (b"{not json", "not JSON"),
    (b"[]", "version None"),
    (json.dumps({"version": 2, "gpus": {}}).encode(), "version 2"),
    (json.dumps({"version": 1, "gpus": []}).encode(), "gpus is list"),
    (json.dumps({"version": 1, "gpus": {GPU: [1, 2]}}).encode(), "is not an object"),
    (json.dumps({"version": 1, "gpus": {GPU: {"a": [1.0]}}}).encode(), "must be [figure, rate]"),
    (json.dumps({"version": 1, "gpus": {GPU: {"a": [-1.0, 2.0]}}}).encode(), "both finite"),
    (json.dumps({"version": 1, "gpus": {GPU: {"a": [0, 2.0]}}}).encode(), "> 0"),
    (b'{"version": 1, "gpus": {"G": {"a": [NaN, 2.0]}}}', "both finite"),
    (b'{"version": 1, "gpus": {"G": {"a": [Infinity, 2.0]}}}', "both finite"),
    (json.dumps({"version": 1, "gpus": {GPU: {"a": ["1", 2.0]}}}).encode(), "[figure, rate]"),
    (json.dumps({"version": 1, "gpus": {GPU: {"a": [True, 2.0]}}}).encode(), "[figure, rate]"),
    (json.dumps({"version": 1, "gpus": {GPU: {"": [1.0, 2.0]}}}).encode(), "allocation id"),
    (json.dumps({"version": 1, "gpus": {"x" * 300: {}}}).encode(), "GPU uuid"),
])
def test_an_unusable_file_is_named_with_why(text, why):
    with pytest.raises(FigureFileError, match="here: .*" + re.escape(why)):
        decode(text, "here")


def test_a_file_too_big_is_not_read_as_figures():
    with pytest.raises(FigureFileError, match="bytes, at most"):
        decode(b" " * (figurefile.MAX_BYTES + 1), "here")


def test_an_unusable_file_loads_as_no_figures_and_says_so(tmp_path):
    path = tmp_path / figurefile.FILE_NAME
    path.write_bytes(json.dumps({"version": 1, "gpus": {GPU: {"a": [-1.0, 2.0]}}}).encode())
    with structlog.testing.capture_logs() as logs:
        assert FigureFile(path).load() == {}
    assert [e["event"] for e in logs] == ["throttle_figures_unusable"]
    assert "a" in logs[0]["error"] and str(path) in logs[0]["error"]
    # and the next save replaces it
    FigureFile(path).save({GPU: {"a": (1.0, 2.0)}})
    assert FigureFile(path).load() == {GPU: {"a": (1.0, 2.0)}}


def test_an_unreadable_file_loads_as_no_figures_and_says_so(tmp_path):
    path = tmp_path / figurefile.FILE_NAME
    path.mkdir()  # (read as a file, a directory fails, as root too)
    with structlog.testing.capture_logs() as logs:
        assert FigureFile(path).load() == {}
    assert [e["event"] for e in logs] == ["throttle_figures_unreadable"]


def test_a_save_where_the_directory_is_gone_raises(tmp_path):
    with pytest.raises(OSError):
        FigureFile(tmp_path / "gone" / figurefile.FILE_NAME).save({GPU: {"a": (1.0, 2.0)}})


def test_the_agent_keeps_its_figures_in_its_state_directory(tmp_path):
    from vgpu_agent.agent import Agent
    from vgpu_agent.config import ConfigSources, build_config

    FigureFile(tmp_path / figurefile.FILE_NAME).save({GPU: {"a": (1.0, 2.0), "b": (3.0, 4.0)}})
    config = build_config(ConfigSources(env={"VGPU_AGENT_BACKEND": "sim",
                                             "VGPU_AGENT_STATE_DIR": str(tmp_path)}))
    with structlog.testing.capture_logs() as logs:
        Agent(config)
    restored = [e for e in logs if e["event"] == "throttle_figures_restored"]
    assert [(e["path"], e["gpus"], e["figures"]) for e in restored] == [
        (str(tmp_path / figurefile.FILE_NAME), 1, 2)]
