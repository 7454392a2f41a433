"""slime_dsa/gpu_utilization.py and the trainer rank's perf/trainer_gpu_busy_share on CPU. NVML cannot run
here: the driver's samples come from a FAKE pynvml (a scripted buffer), and the rank's meter from a FAKE reader."""

from __future__ import annotations

import argparse
import time

import pytest
import torch

from slime_dsa.gpu_utilization import GpuBusyMeter, driver_samples, nvml_device
from trainers.base import CALL_METRIC_PREFIXES, RankConfig
from trainers.rank import TrainerRank


class FakeNVML:
    """A FAKE pynvml (no NVML here): nvmlDeviceGetSamples over a scripted buffer of (wall-clock us, percent), with
    NVML's NOT_FOUND when no sample is newer than the one asked after."""

    NVML_GPU_UTILIZATION_SAMPLES = 1
    NVML_ERROR_NOT_FOUND = 6
    NVML_ERROR_NOT_SUPPORTED = 3

    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            super().__init__(value)
            self.value = value

    def __init__(self, buffer: list[tuple[int, int]], supported: bool = True) -> None:
        self.buffer, self.supported, self.asked_after = buffer, supported, []

    def nvmlDeviceGetSamples(self, handle, kind, after_us):
        assert kind == self.NVML_GPU_UTILIZATION_SAMPLES
        if not self.supported:
            raise self.NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        self.asked_after.append(after_us)
        newer = [argparse.Namespace(timeStamp=t, sampleValue=argparse.Namespace(uiVal=u))
                 for t, u in self.buffer if t > after_us]
        if not newer:
            raise self.NVMLError(self.NVML_ERROR_NOT_FOUND)
        return 1, newer


def test_driver_samples_come_once_each_on_the_perf_counter_clock():
    now_us = int(time.time() * 1e6)
    fake = FakeNVML([(now_us - 300_000, 10), (now_us - 100_000, 20)])  # samples from before the source: skipped
    read = driver_samples(fake, handle=None)
    assert read is not None and read() == [] and fake.asked_after[-1] == now_us - 100_000
    fake.buffer += [(now_us + 50_000, 70), (now_us + 200_000, 90)]
    perf_now, wall_now = time.perf_counter(), time.time()
    got = read()
    assert [u for _, u in got] == [70.0, 90.0]
    assert got[0][0] == pytest.approx(perf_now + (now_us + 50_000) / 1e6 - wall_now, abs=0.01)
    assert got[1][0] - got[0][0] == pytest.approx(0.15)
    assert read() == [] and fake.asked_after[-1] == now_us + 200_000  # each sample once


def test_no_driver_samples_where_the_driver_keeps_none_or_stamps_them_off_the_wall_clock():
    assert driver_samples(FakeNVML([], supported=False), handle=None) is None
    assert driver_samples(FakeNVML([(5_000_000, 40)]), handle=None) is None  # stamped 5 s after boot, not the epoch
    assert driver_samples(FakeNVML([]), handle=None) is not None  # an empty buffer: samples come later


def test_no_nvml_device_on_this_cpu_machine():
    assert nvml_device() is None and GpuBusyMeter.open() is None


def test_the_meter_gives_the_mean_share_of_the_samples_since_its_last_take():
    batches = iter([[(1.0, 40.0), (1.2, 80.0)], [], [(2.0, 100.0)]])
    meter = GpuBusyMeter(lambda: next(batches), poll_s=None)
    assert meter.take() == pytest.approx(0.6)
    assert meter.take() is None  # no sample in between
    assert meter.take() == 1.0


def test_the_meter_polls_so_that_a_long_window_keeps_its_start():
    """The driver keeps only its last samples: the polling thread collects them as they come, and `take` averages
    everything read since the last take."""
    reads = []

    def read():
        reads.append(len(reads) % 2 * 100.0)  # alternately an idle and a busy sample
        return [(time.perf_counter(), reads[-1])]

    meter = GpuBusyMeter(read, poll_s=0.001)
    deadline = time.monotonic() + 5.0
    while len(reads) < 4 and time.monotonic() < deadline:
        time.sleep(0.005)
    meter.close()
    count = len(reads)
    time.sleep(0.02)
    assert count >= 4 and len(reads) == count  # closed: the thread reads no more
    share = meter.take()  # which reads once more itself
    assert len(reads) == count + 1 and share == pytest.approx(sum(reads) / len(reads) / 100.0)


def test_a_failing_reading_gives_no_share_from_then_on_and_never_raises(caplog):
    calls = []

    def broken():
        calls.append(1)
        raise RuntimeError("NVML gone")

    meter = GpuBusyMeter(broken, poll_s=None)
    assert meter.take() is None and meter.take() is None and len(calls) == 1
    assert "GPU utilisation reading failed, no GPU busy share from here on: NVML gone" in caplog.text


def test_rank_0_on_a_gpu_reports_its_busy_share_from_the_second_train_call(monkeypatch):
    batches = iter([[(1.0, 30.0), (1.1, 50.0)]])
    opened = []
    monkeypatch.setattr(GpuBusyMeter, "open", classmethod(
        lambda cls, index=0: opened.append(index) or cls(lambda: next(batches, []), poll_s=None)))
    rank = TrainerRank(0, 1, RankConfig(roles={}))
    assert rank._gpu_busy_share() is None and opened == []  # a CPU rank: no meter
    rank.device = torch.device("cuda", 3)  # FAKE: the device's type and index are all the meter reads of it
    assert rank._gpu_busy_share() is None and opened == [3]  # opened at the first call: nothing measured yet
    assert rank._gpu_busy_share() == pytest.approx(0.4)
    assert rank._gpu_busy_share() is None and opened == [3]  # no new samples; opened once
    other = TrainerRank(1, 2, RankConfig(roles={}))
    other.device = torch.device("cuda", 0)
    assert other._gpu_busy_share() is None and opened == [3]  # only rank 0 measures
    assert "trainer_gpu_busy_share".startswith(CALL_METRIC_PREFIXES)  # a call's metric: logged under perf/ as is
    rank.shutdown()


def test_the_step_line_shows_the_gpu_busy_share_where_there_is_one(capsys):
    from slime_dsa.orchestrator.step import print_step

    print_step(2, 10, {"rollout/reward_mean": 0.5, "perf/step_time_s": 0.35, "perf/trainer_gpu_busy_share": 0.614})
    assert "step 2/10  reward 0.5  step s 0.35  GPU busy 61%" in capsys.readouterr().err
    print_step(1, 10, {"rollout/reward_mean": 0.5})
    assert "GPU busy" not in capsys.readouterr().err
