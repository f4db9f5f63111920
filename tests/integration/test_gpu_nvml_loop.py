"""`shim/tests/gpu/nvml_loop.py` (the controller on a real GPU) run without one: the fake
libnvidia-ml serves per-process samples that a driver thread here derives from what each
stand-in process spent (tests/fakes/gpu_check_standin.py), with 3 points of noise, every 1/6 s.

What this proves is the script, not a GPU: that it finds the processes, reads the shim's
counters, runs the agent's controller and judges it, so that the run on a GPU is spent on
findings rather than on the script's mistakes."""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests import scripts
from tests.fakes import gpu_check_standin
from tests.fakes.fakenvml import FakeNvml
from vgpu_agent.shm import layout

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "shim" / "tests" / "gpu" / "nvml_loop.py"
STANDIN = Path(gpu_check_standin.__file__)


def load_script():
    return scripts.load_script(SCRIPT, "nvml_loop")


class FakeDriver(threading.Thread):
    """Publishes an NVML sample per running stand-in every 1/6 s: the share its `state` shows
    it spent since the last sample, plus noise (sigma 3 points), clamped to 0..100. With
    `time_sliced`, as the H200 without MPS: each period's one sample goes to one of the
    processes that spent, drawn by what they spent, with the whole GPU's use as its value (all
    listed at 0 where none spent)."""

    def __init__(self, fake: FakeNvml, regions: Path, time_sliced: bool = False):
        super().__init__(daemon=True)
        self.fake, self.regions = fake, regions
        self.uuid = fake.uuids[0]
        self.stopped = threading.Event()
        self.rng = random.Random(7)
        self.published = 0
        self.time_sliced = time_sliced

    def run(self) -> None:
        last: dict[Path, tuple[float, int]] = {}
        samples: list[tuple[int, int, int]] = []
        while not self.stopped.wait(1 / 6):
            now = time.monotonic()
            stamp_us = int(time.time() * 1e6)  # one period: every process's sample carries it
            period: list[tuple[int, float]] = []
            for state in self.regions.glob("*/state"):
                buf = state.read_bytes()
                spent = layout.state_counters(buf, 1)
                pid = int.from_bytes(buf[layout.STATE_OFFSETS["slots"]:][:8], "little")
                if not spent or not pid:
                    continue
                was = last.get(state)
                last[state] = (now, spent[0])
                if was is None or not _alive(pid):
                    continue
                share = 100 * (spent[0] - was[1]) / (now - was[0]) \
                    / gpu_check_standin.FULL_TOKENS_PER_S
                period.append((pid, share))
            idle = False
            if self.time_sliced:
                ran = [(pid, share) for pid, share in period if share > 0]
                if ran:
                    pid = self.rng.choices([p for p, _ in ran], [v for _, v in ran])[0]
                    whole = sum(v for _, v in ran)
                    period = [(pid, whole)]
                else:
                    # nobody ran (a loaded machine's stand-ins, or all paused): every process
                    # listed idle at 0, as the H200 lists them. With noise, two of them above 0
                    # in one stamp would read as per-process samples, and the GPU so.
                    idle = True
            for pid, share in period:
                sm = 0 if idle else min(100, max(0, round(share + self.rng.gauss(0, 3))))
                samples.append((pid, stamp_us, sm))
            samples = samples[-40:]
            self.fake.set_process_samples(self.uuid, samples)
            self.published += 1


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def _stand_ins(fake_nvml: FakeNvml, tmp_path: Path, time_sliced: bool = False
               ) -> tuple[Path, Path, FakeDriver]:
    """A `gpu_check` that runs the stand-in process, the script's output directory, and the
    fake driver publishing the processes' use (started)."""
    check = tmp_path / "gpu_check"
    check.write_text(f"#!/bin/sh\nexec {sys.executable} {STANDIN} \"$@\"\n")
    check.chmod(0o755)
    out = tmp_path / "out"
    (out / "regions").mkdir(parents=True)
    driver = FakeDriver(fake_nvml, out / "regions", time_sliced=time_sliced)
    driver.start()
    return check, out, driver


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_gpu_loop_script_runs_and_judges_the_controller(fake_nvml: FakeNvml, tmp_path,
                                                              capsys):
    check, out, driver = _stand_ins(fake_nvml, tmp_path)
    try:
        code = load_script().main([str(check), "", "--out", str(out), "--nvml-library",
                                   str(fake_nvml.library_path), "--hold", "5",
                                   "--seconds", "8", "--alone", "3", "--phase", "4",
                                   "--quick"])
    finally:
        driver.stopped.set()
        driver.join()
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert driver.published > 20
    assert "cost of nvmlDeviceGetProcessUtilization" in printed
    # The fixed rates: the script's truth is the stand-in's spending, 100 / 50 / 20 %.
    found = [json.loads(line) for line in (out / "nvml_summary.jsonl").read_text().splitlines()]
    assert [f["truth_pct"] for f in found] == pytest.approx([100, 50, 20, 20, 20], abs=5)
    # Each case's window is its hold less 4 s (start-up, then the end left out): 2.5 s, 15
    # samples at 6 Hz where the driver thread keeps its pace, fewer on a loaded machine.
    for f, pct in zip(found, (100, 50, 20, 20, 20), strict=True):
        assert f["samples"] > 5
        assert f["period_ms_median"] == pytest.approx(1000 / 6, rel=0.5)
        assert f["sm_mean"] == pytest.approx(pct, abs=8)
    # The controller held the strict containers (together from the start, and each alone
    # first: the stand-ins' regions hold a first process each, then a second) and lent to the
    # work-conserving ones.
    # (and in a third case, the first container's process replaced by another at 4 s: a
    # change of phase, the region's counters going on across it)
    for case in ("strict20", "strict20_alone_first", "strict20_phase"):
        strict = [json.loads(line) for line in (out / f"loop_{case}.jsonl").read_text()
                  .splitlines()]
        for container, goal in ((0, 30), (1, 50)):
            # (the windows before a replacing process first spent are no share to hold)
            tail = [r["share"] for r in strict if r["container"] == container and r["t"] >= 5
                    and not r["starting"]]
            assert tail and sum(tail) / len(tail) == pytest.approx(goal, abs=5), case
            assert all(r["rate"] for r in strict if r["container"] == container and r["t"] >= 2)
    # only the replaced process's own windows, and only until it spent, are marked starting
    phase = [json.loads(line) for line in (out / "loop_strict20_phase.jsonl").read_text()
             .splitlines()]
    marked = [r for r in phase if r["starting"]]
    assert all(r["container"] == 0 and r["t"] >= 4 for r in marked), marked
    assert len(marked) < 4, marked
    lending = [json.loads(line) for line in (out / "loop_lending20.jsonl").read_text().splitlines()]
    tail = [r["share"] for r in lending if r["t"] >= 5]
    assert sum(tail) / (len(tail) / 2) > 60  # 20 + 20 granted, the idle rest lent out


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_gpu_loop_script_reports_a_turn_alone_on_a_time_sliced_gpu(fake_nvml: FakeNvml,
                                                                        tmp_path, capsys):
    check, out, driver = _stand_ins(fake_nvml, tmp_path, time_sliced=True)
    script = load_script()
    # of the late reads' cases, the pair alone (each case reads for 10 s): two processes are
    # what a time-sliced GPU attributes one period at a time
    script.LATE_CASES = (((30, 20), (50, 20)),)
    try:
        script.main([str(check), "", "--out", str(out), "--nvml-library",
                            str(fake_nvml.library_path), "--hold", "4", "--seconds", "18",
                            "--alone", "0", "--controller-only", "--quick", "--only",
                            "strict20", "--trace", "--late-reads"])
    finally:
        driver.stopped.set()
        driver.join()
    printed = capsys.readouterr().out
    (line,) = [ln for ln in printed.splitlines() if ln.startswith("  strict20:")]
    # the first container's turn; the second's 3 s after it where the GPU was seen counting
    # busy beyond the work (this fake's readings may or may not show that), else a minute on
    assert "read time-sliced ['GPU-" in line, line
    turns = 2 if "turns alone 2" in line else 1
    assert f"turns alone {turns}" in line, line
    assert "paused for a turn alone at t = " in printed
    # reads further apart than a period bring several periods at once
    late = [json.loads(ln) for ln in (out / "late_reads.jsonl").read_text().splitlines()]
    assert {r["gap_s"] for r in late} == {0.02, 0.4, 1.0}
    assert max(len(r["samples"]) for r in late if r["gap_s"] == 1.0) >= 4
    assert "read every 1 s: values per read" in printed
    # only the case asked for, traced: every NVML read, and every split of the use
    assert sorted(f.name for f in out.glob("loop_*")) == ["loop_strict20.jsonl"]
    trace = [json.loads(ln) for ln in (out / "trace_strict20.jsonl").read_text().splitlines()]
    reads = [t for t in trace if "samples" in t]
    splits = [t for t in trace if "owners" in t]
    assert sum(len(t["samples"]) for t in reads) > 20
    assert len(splits) > 20 and all(sum(t["shares"].values()) <= t["busy"] + 1e-6
                                    for t in splits)
    # ... with what a launch costs where one container spent alone (a replay needs it)
    assert all("per_launch" in t for t in splits)
    assert any(cost > 0 for t in splits for cost in t["per_launch"].values())
    rows = [json.loads(ln) for ln in (out / "loop_strict20.jsonl").read_text().splitlines()]
    # each measured in turn while the other was paused, then both spending again
    paused = {c: [r["t"] for r in rows if r["container"] == c and r["paused"]] for c in (0, 1)}
    assert paused[1], rows
    if turns == 2:
        assert paused[0] and max(paused[1]) < min(paused[0])  # the first container's came first
    else:
        assert not paused[0], rows
    # a turn alone lasts a second or two (seen through 0.5 s windows) ...
    for container in (0, 1):
        assert not paused[container] or max(paused[container]) - min(paused[container]) <= 3
    # ... and both spend again after each, where the run leaves a second or more to see it:
    # between the turns, and after the second if one came. That came 7.5-12 s in over eleven
    # runs here (once near the end on a busy machine), after evidence of the GPU counting busy
    # beyond the work that the fake's noise gives sooner or later; where that evidence comes
    # before the first turn, the second follows it at once (a pair's second).
    windows = [(max(paused[1]) + 1, min(paused[0]) if turns == 2 else float("inf"))]
    if turns == 2:
        windows.append((max(paused[0]) + 1, float("inf")))
    seen = 0
    for low, high in windows:
        for container in (0, 1):
            got = [r["share"] for r in rows if r["container"] == container and low < r["t"] < high]
            if len(got) >= 2:
                assert sum(got) / len(got) > 5, rows
                seen += 1
    assert seen >= 2, rows


@pytest.mark.parametrize(("rate", "seconds"), [(10_000_000, 0.5), (45, 1.0)])
def test_the_stand_in_spends_what_its_control_grants(tmp_path, rate, seconds):
    # 45 tokens a second is under one token a 20 ms step: spent all the same, as a shim's
    # bucket lets a slow rate through over time (dropping the fractions spent nothing, and a
    # strict container whose first tick caught its process starting was never measured again)
    region = tmp_path / "r"
    region.mkdir()
    device = layout.ControlDevice("GPU-x", 0, 500_000, rate, 1_000_000,
                                  layout.POLICY_STRICT, 0)
    (region / "control").write_bytes(layout.encode_control(
        layout.Control(devices=(device,), device_ids=("GPU-x::0",), seq=1, created_ns=1)))
    (region / "state").write_bytes(layout.encode_state(1))
    os.environ["VGPU_REGION_DIR"] = str(region)
    try:
        sys.argv = ["standin", "throughput", str(seconds), "1024", "128", "20"]
        assert gpu_check_standin.main() == 0
    finally:
        del os.environ["VGPU_REGION_DIR"]
    state = (region / "state").read_bytes()
    spent = layout.state_counters(state, 1)
    assert spent is not None and spent[0] == pytest.approx(rate * seconds, rel=0.2)
    # as a shim's: the device's total is what its one process's slot says it spent, no more
    (process,) = layout.decode_state(state, 1).processes
    assert (spent[0], spent[1]) == (process.tokens_spent[0], process.launches[0])


def test_the_hold_per_launch_is_fitted_only_from_one_unsaturated_figure():
    script = load_script()
    held = script.Held
    # 200 us kernels, 5,000 launches a second unthrottled: the H200's 20 + 20 % read 66
    full = {200: 5_000 * script.COST}
    pair = (held(20, 200), held(20, 200))
    hold = script.launch_hold_us(pair, [{"sm_mean": 66}, {"sm_mean": 66}], 40.0, full)
    assert hold == pytest.approx(130)
    # per-process samples (each its own work), a saturated figure, two figures apart, an
    # unthrottled process: nothing to fit
    for means in ((20, 20), (99, 99), (60, 70)):
        found = [{"sm_mean": m} for m in means]
        assert script.launch_hold_us(pair, found, 40.0, full) is None
    assert script.launch_hold_us((held(None, 200), held(20, 200)),
                                 [{"sm_mean": 66}, {"sm_mean": 66}], 40.0, full) is None


def test_fixed_rate_cases_are_read_from_the_command_line():
    script = load_script()
    cases = script.parse_cases("80@200, 90@20+0@200")
    assert [[(h.pct, h.spin_us) for h in case] for case in cases] == [
        [(None, 20)], [(None, 200)], [(80.0, 200)], [(90.0, 20), (0.0, 200)]]
    for bad in ("80", "80@", "x@20", "101@20", "-1@20", "50@0", "50@20+full"):
        with pytest.raises(argparse.ArgumentTypeError, match="SHARE@US"):
            script.parse_cases(bad)


@contextmanager
def _backend_on(fake_nvml: FakeNvml, driver: FakeDriver) -> Iterator[tuple[Any, Any, str]]:
    """The script, its NVML backend started on the fake library, and the first GPU's UUID; the
    backend and the fake driver stopped after."""
    script = load_script()
    backend = script.NvmlBackend(str(fake_nvml.library_path))
    backend.start()
    try:
        yield script, backend, backend.discover().gpus[0].uuid
    finally:
        backend.shutdown()
        driver.stopped.set()
        driver.join()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_paused_process_holds_its_context_and_is_stopped_after_its_case(fake_nvml: FakeNvml,
                                                                         tmp_path):
    check, out, driver = _stand_ins(fake_nvml, tmp_path)
    with _backend_on(fake_nvml, driver) as (script, backend, uuid):
        full = {20: 0.0}
        (full[20], _, _), = script.hold(str(check), "", backend, out / "regions", uuid,
                                       (script.Held(None, 20),), full, 3.0)
        started = time.monotonic()
        busy, paused = script.hold(str(check), "", backend, out / "regions", uuid,
                                   (script.Held(50, 20), script.Held(0, 20)), full, 3.0)
    assert time.monotonic() - started < 10  # not left to run out its 30 s wait
    # Held at half of the full run's rate: never above it; below it only as far as a machine
    # loaded between the two runs slows the stand-in (its launches are paced by sleeps).
    assert full[20] * 0.3 < busy[0] < full[20] / 2 * 1.1
    assert paused[0] < full[20] / 100


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_process_slow_to_start_is_measured_from_its_first_spending(fake_nvml: FakeNvml,
                                                                    tmp_path, capsys):
    # as on a loaded machine: the process spends nothing for its first 2.5 s, where the window
    # would have begun (1.5 s) and ended (2 s); it was measured at 0 tokens a second
    check, out, driver = _stand_ins(fake_nvml, tmp_path)
    late = tmp_path / "gpu_check_late"
    late.write_text(f"#!/bin/sh\nsleep 2.5\nexec {check} \"$@\"\n")
    late.chmod(0o755)
    with _backend_on(fake_nvml, driver) as (script, backend, uuid):
        full = {20: 1_000_000.0}
        (held, _, _), = script.hold(str(late), "", backend, out / "regions", uuid,
                                    (script.Held(50, 20),), full, 3.0)
        # a process that ends before it spent: no window, said, and 0
        (never, _, _), = script.hold(str(late), "", backend, out / "regions", uuid,
                                     (script.Held(50, 20),), full, 0.0)
    # its rate, within what a loaded machine's late steps at the window's two ends can move a
    # 0.5 s window (the old window read 0.0)
    assert 500_000 * 0.6 < held < 500_000 * 1.4
    assert never == 0.0
    assert "no window measured" in capsys.readouterr().out


def test_periods_together_tell_per_process_from_time_sliced_attribution():
    script = load_script()
    per_process = [[{"ts_us": t, "sm": 48} for t in (1, 2, 3)],
                   [{"ts_us": t, "sm": 50 + t} for t in (1, 2, 3)]]
    found = script.periods_together(per_process, [])
    assert (found["periods"], found["shared"], found["sum_median"], found["sum_max"]) == (
        3, 3, 100, 101)
    assert "their sum median 100" in script.describe_together(found)
    # each period whole to one process, as the H200 gave them without MPS: nothing to sum
    sliced = [[{"ts_us": 1, "sm": 99}, {"ts_us": 3, "sm": 99}], [{"ts_us": 2, "sm": 99}]]
    found = script.periods_together(sliced, [])
    assert (found["periods"], found["shared"], found["sum_median"]) == (3, 0, None)
    assert "every process 0" in script.describe_together(found)
    # stamped a few ms apart within each period, per process: not one period by stamps,
    # but one within the near reach (40 ms), with how far apart they lay
    period_us = 166_667
    apart = [[{"ts_us": k * period_us, "sm": 40} for k in range(1, 5)],
             [{"ts_us": k * period_us + 3_000 * k, "sm": 61} for k in range(1, 5)]]
    found = script.periods_together(apart, [])
    assert (found["periods"], found["shared"], found["near_shared"]) == (8, 0, 4)
    assert (found["near_sum_median"], found["near_spread_us_max"]) == (101, 12_000)
    assert "within 40 ms read as one period: 4, their sum median 101, stamps up to 12 ms" \
        in script.describe_together(found)
    # ... while periods a whole sample period apart stay apart, however near the reach
    sliced_apart = [[{"ts_us": k * period_us, "sm": 99} for k in (1, 3)],
                    [{"ts_us": 2 * period_us, "sm": 99}]]
    found = script.periods_together(sliced_apart, [], near_us=period_us // 2)
    assert (found["shared"], found["near_shared"]) == (0, 0)
    assert "read as one period" not in script.describe_together(found)
    # samples of a process outside the case (under MPS, perhaps its server) are named
    found = script.periods_together(sliced, [{"pid": 7, "ts_us": 1, "sm": 99}] * 2)
    assert (found["others"], found["other_pids"]) == (2, [7])
    assert "2 samples of other processes, pids [7]" in script.describe_together(found)


def _mps_control(tmp_path: Path, start_exit: int = 0) -> tuple[Path, Path]:
    """A stand-in for nvidia-cuda-mps-control: notes `-d` and what it is told on stdin, each
    with the MPS directories it was given, and exits `start_exit` on `-d`."""
    log, control = tmp_path / "mps.log", tmp_path / "mps-control"
    control.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "-d" ]; then\n'
        f'  echo "start $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY" >> {log}\n'
        f"  echo 'cannot start: a daemon of this pipe directory runs' >&2; exit {start_exit}\n"
        "fi\n"
        f'read told; echo "$told $CUDA_MPS_PIPE_DIRECTORY" >> {log}\n')
    control.chmod(0o755)
    return control, log


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_mps_runs_every_process_under_a_daemon_of_the_runs_own_then_quits_it(
        fake_nvml: FakeNvml, tmp_path, capsys):
    control, log = _mps_control(tmp_path)
    check, out, driver = _stand_ins(fake_nvml, tmp_path)
    seen = tmp_path / "seen"  # the MPS pipe directory each process was started with
    check.write_text(f'#!/bin/sh\necho "$CUDA_MPS_PIPE_DIRECTORY" >> {seen}\n'
                     f'exec {sys.executable} {STANDIN} "$@"\n')
    try:
        code = load_script().main([str(check), "", "--out", str(out), "--nvml-library",
                                   str(fake_nvml.library_path), "--hold", "5", "--mps",
                                   "--mps-control", str(control), "--cases", "45@20+45@20",
                                   "--only", "none"])
    finally:
        driver.stopped.set()
        driver.join()
    printed = capsys.readouterr().out
    assert code == 0, printed
    pipe, logs = out / "mps" / "pipe", out / "mps" / "log"
    assert log.read_text().splitlines() == [f"start {pipe} {logs}", f"quit {pipe}"]
    assert seen.read_text().split() == [str(pipe)] * 3  # the unthrottled one, then the pair
    assert not any(name in os.environ for name in ("CUDA_MPS_PIPE_DIRECTORY",
                                                    "CUDA_MPS_LOG_DIRECTORY"))
    # this fake driver gives each process its own samples: the pair's add up to its work
    pair = [json.loads(line) for line in (out / "nvml_summary.jsonl").read_text().splitlines()][-1]
    together = pair["periods_together"]
    # (a 2.5 s window: 15 periods at 6 Hz, fewer where a loaded machine slows the driver)
    assert together["shared"] > 5 and together["others"] == 0
    assert together["sum_median"] == pytest.approx(90, abs=10)
    assert "with a sample of every process" in printed


def test_mps_that_does_not_start_is_named_and_nothing_runs(fake_nvml: FakeNvml, tmp_path,
                                                             capsys):
    control, log = _mps_control(tmp_path, start_exit=1)
    code = load_script().main([str(tmp_path / "no-check"), "", "--out", str(tmp_path / "out"),
                               "--nvml-library", str(fake_nvml.library_path), "--mps",
                               "--mps-control", str(control)])
    printed = capsys.readouterr().out
    assert code == 1
    assert f"{control} -d exited 1: cannot start: a daemon of this pipe directory runs" in printed
    assert "1. the NVML backend" not in printed
    assert len(log.read_text().splitlines()) == 1  # started, never told to quit
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
    missing = load_script().main([str(tmp_path / "no-check"), "", "--out", str(tmp_path / "o2"),
                                  "--nvml-library", str(fake_nvml.library_path), "--mps",
                                  "--mps-control", str(tmp_path / "absent")])
    assert missing == 1
    assert f"{tmp_path / 'absent'} -d:" in capsys.readouterr().out
