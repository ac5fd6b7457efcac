"""The board sampler: statistics from readings, the thread's life, NVML's absence (no GPU needed)."""

import ctypes
import threading
import time

import numpy as np
import pytest

from dspark_jax import PowerSampler, gpu_power


def test_summary_matches_numpy_over_the_readings():
    readings = [(690.0, 1620.0, 0x4), (700.0, 1500.0, 0x4 | 0x20), (300.0, 1980.0, 0x0), (650.0, 1755.0, 0x80)]
    sampler = PowerSampler(reader=(lambda: readings[0], 700.0))
    sampler.samples = list(readings)
    got = sampler.summary()
    power, clock = np.array([r[0] for r in readings]), np.array([r[1] for r in readings])
    assert got == {
        "samples": 4,
        "sm_clock_mhz_median": float(np.median(clock)),
        "sm_clock_mhz_p10": float(np.percentile(clock, 10)),
        "power_w_median": float(np.median(power)),
        "power_limit_w": 700.0,
        "power_capped_share": 0.5,  # bit 0x4 in the first two
        "thermal_share": 0.25,  # 0x20 in the second
        "hw_slowdown_share": 0.25,  # 0x80 (power brake) in the fourth
    }


def _reader_of(readings, *, limit=None, wanted=None):
    """A reader that returns ``readings`` in turn (then repeats the last) and sets the returned
    event once ``wanted`` of them were read: the tests wait on it instead of on the clock."""
    calls, enough = [], threading.Event()

    def read():
        calls.append(len(calls))
        if wanted is not None and len(calls) >= wanted:
            enough.set()
        return readings[min(len(calls), len(readings)) - 1]

    return (read, limit), calls, enough


def test_sampler_polls_while_the_block_runs_and_stops_after():
    reader, calls, enough = _reader_of([(500.0, 1800.0, 0)], wanted=3)
    with PowerSampler(interval_s=0.001, reader=reader) as sampler:
        assert sampler.available
        assert enough.wait(timeout=10)  # the thread polls while the block runs
    taken = len(calls)
    assert taken >= 3 and len(sampler.samples) == taken
    time.sleep(0.02)
    assert len(calls) == taken  # the thread has stopped
    assert sampler.summary()["power_limit_w"] is None


def test_each_block_samples_afresh_and_blocks_do_not_nest():
    reader, calls, _ = _reader_of([(500.0, 1800.0, 0), (400.0, 1700.0, 0)])
    sampler = PowerSampler(interval_s=60.0, reader=reader)  # one reading on entry, then the exit wakes it
    with sampler:
        pass
    assert sampler.samples == [(500.0, 1800.0, 0)]
    with sampler:
        pass
    assert sampler.samples == [(400.0, 1700.0, 0)] and len(calls) == 2
    with pytest.raises(RuntimeError, match="already sampling"), sampler:
        sampler.__enter__()


def test_failed_readings_are_left_out():
    reader, _, enough = _reader_of([None, (600.0, 1700.0, 0x4), None], limit=700.0, wanted=4)
    with PowerSampler(interval_s=0.001, reader=reader) as sampler:
        assert enough.wait(timeout=10)
    assert sampler.samples == [(600.0, 1700.0, 0x4)]
    assert sampler.summary()["samples"] == 1 and sampler.summary()["power_w_median"] == 600.0


def test_without_nvml_the_sampler_records_nothing(monkeypatch):
    monkeypatch.setattr(gpu_power, "nvml_reader", lambda device=None: None)
    with PowerSampler() as sampler:
        time.sleep(0.005)
    assert not sampler.available and sampler.samples == [] and sampler.summary() is None


def test_nvml_reader_is_none_without_the_driver_library(monkeypatch):
    def missing(name, *args, **kwargs):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", missing)
    assert gpu_power.nvml_reader() is None


@pytest.mark.parametrize(
    ("visible", "expected"),
    [(None, 0), ("", None), ("3,1", 3), (" 2", 2), ("GPU-8f2e", "GPU-8f2e"), ("MIG-1a2b", "MIG-1a2b")],
)
def test_nvml_device_follows_cuda_visible_devices(monkeypatch, visible, expected):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert gpu_power.nvml_device_index() == expected


@pytest.mark.parametrize("interval", [0, -0.01, True, "0.01", None])
def test_bad_interval_is_refused(interval):
    with pytest.raises(ValueError, match="interval_s=.* is invalid: must be a positive number of seconds"):
        PowerSampler(interval_s=interval, reader=(lambda: (0.0, 0.0, 0), None))


class _FakeNvml:
    """NVML's C entry points as ``nvml_reader`` calls them: each writes its answer through the
    ``byref`` pointer and returns 0 (success) or the code set in ``fail``."""

    def __init__(self, *, power_mw=650_123, clock_mhz=1755, bits=0x4, limit_mw=700_000, fail=()):
        self.answers = {"power": power_mw, "clock": clock_mhz, "bits": bits, "limit": limit_mw}
        self.fail, self.handles = set(fail), []

    def _answer(self, what, ref):
        if what in self.fail:
            return 999
        ref._obj.value = self.answers[what]
        return 0

    def nvmlInit_v2(self):
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, index, ref):
        self.handles.append(index.value)
        return 0

    def nvmlDeviceGetHandleByUUID(self, uuid, ref):
        self.handles.append(uuid)
        return 0

    def nvmlDeviceGetEnforcedPowerLimit(self, handle, ref):
        return self._answer("limit", ref)

    def nvmlDeviceGetPowerUsage(self, handle, ref):
        return self._answer("power", ref)

    def nvmlDeviceGetClockInfo(self, handle, kind, ref):
        assert kind == 1  # NVML_CLOCK_SM
        return self._answer("clock", ref)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle, ref):
        return self._answer("bits", ref)


def test_nvml_reader_converts_milliwatts_to_watts_and_picks_the_visible_device(monkeypatch):
    """NVML reports power and the limit in mW: the reader gives W; the clock in MHz and the reason
    bits as read; the device is the first of ``CUDA_VISIBLE_DEVICES`` (an index or a UUID)."""
    nvml = _FakeNvml()
    monkeypatch.setattr(ctypes, "CDLL", lambda name: nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    read, limit_w = gpu_power.nvml_reader()
    assert limit_w == 700.0 and nvml.handles == [2]
    assert read() == (650.123, 1755.0, 0x4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8f2e")
    gpu_power.nvml_reader()
    assert nvml.handles == [2, b"GPU-8f2e"]


@pytest.mark.parametrize("failing", ["power", "clock", "bits"])
def test_a_reading_with_any_failed_query_is_none_and_an_unknown_limit_is_none(monkeypatch, failing):
    """One failed query is enough to drop the reading (its zeros would skew the medians)."""
    monkeypatch.setattr(ctypes, "CDLL", lambda name: _FakeNvml(fail={failing, "limit"}))
    read, limit_w = gpu_power.nvml_reader(0)
    assert limit_w is None and read() is None


def test_thermal_and_hardware_slowdown_shares_count_each_of_their_bits():
    """THERMAL is the software (0x20) and hardware (0x40) thermal bits; HW_SLOWDOWN the hardware
    slowdown (0x8) and power-brake (0x80) bits."""
    readings = [(1.0, 1.0, 0x40), (1.0, 1.0, 0x8), (1.0, 1.0, 0x20 | 0x80), (1.0, 1.0, 0x4), (1.0, 1.0, 0)]
    sampler = PowerSampler(reader=(lambda: readings[0], None))
    sampler.samples = list(readings)
    got = sampler.summary()
    bits = np.array([r[2] for r in readings])
    assert got["thermal_share"] == np.mean((bits & 0x60) != 0) == 0.4
    assert got["hw_slowdown_share"] == np.mean((bits & 0x88) != 0) == 0.4
    assert got["power_capped_share"] == 0.2


@pytest.mark.parametrize("visible", ["NoDevFiles", "-1", "none", ""])
def test_a_visible_devices_word_that_is_no_index_or_uuid_means_no_gpu(monkeypatch, visible):
    """SLURM sets ``CUDA_VISIBLE_DEVICES=NoDevFiles`` on a job without GPUs (``-1`` and ``""``
    hide every GPU too): neither an index nor a UUID, so the process sees no GPU and no board is
    read (not GPU 0's, which another process may be using), nor ``int()`` of the word."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert gpu_power.nvml_device_index() is None
    calls = []

    class FakeNvml:
        def nvmlInit_v2(self):
            return 0

        def __getattr__(self, name):  # any device query would be a bug here
            calls.append(name)
            return lambda *args: 0

    monkeypatch.setattr(gpu_power.ctypes, "CDLL", lambda name: FakeNvml())
    assert gpu_power.nvml_reader() is None and calls == []
