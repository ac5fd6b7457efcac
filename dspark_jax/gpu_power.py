"""The GPU board's power, SM clock and clock-limit reasons, sampled through NVML while timing.

Why: an H200 held busy draws its 700 W limit within a second, and its driver then lowers the
SM clock (README notes 56 and 83). The same batch-128 draft round measured 5.32 ms waited with
3 ms of idle before each call (SM clock 1980 MHz, no limit reason) and 5.86–5.93 ms with calls
back to back (1605–1650 MHz, "software power cap" in every sample). A latency read without the
board's state cannot tell code from clock. :class:`PowerSampler` polls the board from a
background thread while a block of code runs, and :meth:`PowerSampler.summary` says what the
clock and the power were.

NVML is read through ``ctypes`` from the driver's ``libnvidia-ml.so.1``: no package to install.
Where there is no NVIDIA driver (CPU machines, TPUs), :func:`nvml_reader` returns None and the
sampler records nothing.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable

import numpy as np

Reading = tuple[float, float, int]
"""One sample: board power (W), SM clock (MHz), clock-limit reason bits (NVML's ``clocksEventReasons``)."""

Reader = tuple[Callable[[], Reading | None], float | None]
"""``(read, power_limit_w)``: ``read()`` returns one :data:`Reading`, or None when a query failed;
the board's enforced power limit in W, or None where the driver does not report it."""

SW_POWER_CAP = 0x4
"""NVML's reason bit: the driver holds the clock down to keep the board under its power limit."""

THERMAL = 0x20 | 0x40
"""NVML's software and hardware thermal slowdown bits."""

HW_SLOWDOWN = 0x8 | 0x80
"""NVML's hardware slowdown and power-brake bits."""

_NVML_CLOCK_SM = 1


def nvml_device_index() -> int | str | None:
    """The NVML device of the process's first visible GPU: index 0 where
    ``CUDA_VISIBLE_DEVICES`` is unset (NVML numbers every GPU on the host and ignores that
    variable), else its first entry (an index, or a ``GPU-…`` / ``MIG-…`` UUID), and None
    where the variable names no GPU (``""``, ``-1``, SLURM's ``NoDevFiles``: CUDA then sees
    none, and another GPU's board would be read)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return 0
    first = visible.split(",")[0].strip()
    if first.isdigit():
        return int(first)
    return first if first.startswith(("GPU-", "MIG-")) else None


def nvml_reader(device: int | str | None = None) -> Reader | None:
    """NVML's :data:`Reader` for one device: a function that reads one :data:`Reading` (None when
    a query fails), and the board's enforced power limit (W).

    Args:
      device: NVML index or UUID (None: :func:`nvml_device_index`).

    Returns:
      ``(read, power_limit_w)``, or None where NVML cannot be loaded, the device is not
      found (no NVIDIA driver) or the process sees no GPU. ``power_limit_w`` is None where
      the driver does not report it.
    """
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    device = nvml_device_index() if device is None else device
    if device is None:  # the process sees no GPU
        return None
    handle = ctypes.c_void_p()
    if isinstance(device, str):
        found = nvml.nvmlDeviceGetHandleByUUID(device.encode(), ctypes.byref(handle))
    else:
        found = nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(device), ctypes.byref(handle))
    if found != 0:
        return None
    # renamed in CUDA 12.2's driver (reasons are no longer all "throttling"); same bits
    reasons = (
        getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
    )
    limit = ctypes.c_uint()
    limit_w = limit.value / 1e3 if nvml.nvmlDeviceGetEnforcedPowerLimit(handle, ctypes.byref(limit)) == 0 else None

    def read() -> Reading | None:
        power, clock, bits = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_ulonglong()
        failed = (
            nvml.nvmlDeviceGetPowerUsage(handle, ctypes.byref(power)),  # mW
            nvml.nvmlDeviceGetClockInfo(handle, _NVML_CLOCK_SM, ctypes.byref(clock)),  # MHz
            reasons(handle, ctypes.byref(bits)),
        )
        if any(failed):  # NVML's return codes, 0 for success: a zeroed reading would skew the medians
            return None
        return power.value / 1e3, float(clock.value), int(bits.value)

    return read, limit_w


class PowerSampler:
    """Samples the board every ``interval_s`` from a background thread while the block runs.

    Example::

        with PowerSampler() as board:
            timings = time_calls(calls, iters=100)
        board.summary()  # {"sm_clock_mhz_median": 1620.0, "power_capped_share": 1.0, ...} or None

    Args:
      interval_s: seconds between samples, > 0. The default, 20 ms, wakes the sampler's thread
        rarely (a reading took 4.3 µs on the H200 host, and the timed medians did not move with
        the sampler on: README note 84).
      reader: a :data:`Reader` (None: NVML's, where there is one); failed readings are left out.

    Raises:
      ValueError: ``interval_s`` is not a positive number.
      TypeError: ``reader`` is not a :data:`Reader` or None.
    """

    def __init__(self, *, interval_s: float = 0.02, reader: Reader | None = None):
        if isinstance(interval_s, bool) or not isinstance(interval_s, (int, float)) or not interval_s > 0:
            raise ValueError(f"interval_s={interval_s!r} is invalid: must be a positive number of seconds")
        self.interval_s = float(interval_s)
        if reader is not None and not (isinstance(reader, tuple) and len(reader) == 2 and callable(reader[0])):
            raise TypeError(f"reader={reader!r} is invalid: must be a Reader (read, power_limit_w) or None (NVML's)")
        self._reader = nvml_reader() if reader is None else reader
        self.samples: list[Reading] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        """True when there is a board to read (an NVML device, or the reader given)."""
        return self._reader is not None

    def _poll(self) -> None:
        read = self._reader[0]
        while True:
            reading = read()
            if reading is not None:
                self.samples.append(reading)
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> PowerSampler:
        if self._thread is not None:
            raise RuntimeError("PowerSampler: already sampling")
        self.samples, self._stop = [], threading.Event()
        if self._reader is not None:
            self._thread = threading.Thread(target=self._poll, name="PowerSampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def summary(self) -> dict[str, float | int | None] | None:
        """What the board did while the block ran, or None when nothing was sampled.

        Returns:
          ``samples``; ``sm_clock_mhz_median`` and ``sm_clock_mhz_p10``; ``power_w_median``;
          ``power_limit_w`` (None where unknown); the shares of samples whose reasons hold
          :data:`SW_POWER_CAP` (``power_capped_share``), :data:`THERMAL` (``thermal_share``) and
          :data:`HW_SLOWDOWN` (``hw_slowdown_share``).
        """
        if not self.samples:
            return None
        power, clock, bits = (np.asarray(column) for column in zip(*self.samples, strict=True))
        bits = bits.astype(np.int64)
        return {
            "samples": len(self.samples),
            "sm_clock_mhz_median": float(np.median(clock)),
            "sm_clock_mhz_p10": float(np.percentile(clock, 10)),
            "power_w_median": float(np.median(power)),
            "power_limit_w": self._reader[1],
            "power_capped_share": float(np.mean(bits & SW_POWER_CAP != 0)),
            "thermal_share": float(np.mean(bits & THERMAL != 0)),
            "hw_slowdown_share": float(np.mean(bits & HW_SLOWDOWN != 0)),
        }
