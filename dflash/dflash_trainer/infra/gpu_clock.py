"""The GPU's SM clock and board power while a benchmark runs, sampled by nvidia-smi in the background.

Why the benchmark reports them: MFU is measured against the datasheet's dense bf16 peak, which an
H100/H200 reaches at 1,830 MHz (132 SMs x 4,096 FLOP per SM per clock), and these GPUs hold that clock
only in bursts. On an H200, GEMMs run back to back settle near 1,500 MHz at 610-670 W and 660-690
TFLOP/s; the same GEMMs with idle gaps between them run at 1,975 MHz and 715-790 TFLOP/s. So part of
the distance between a step's MFU and 100% is the clock the board sustains, and runs of the same code
differ with it between machines. What holds the clock down is the board's power limit: a bf16 GEMM
loop on an H200 drew 688-695 W of its 700 W with the driver's "SW power cap" clock event active in
every sample (1,410-1,485 MHz, 649 TFLOP/s), so the sampler records that flag and the limit too.
nvidia-smi rather than NVML's Python binding: it ships with the driver userspace of every GPU host
and container, the binding is not in the frozen environment.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
from typing import NamedTuple, Self

import torch

QUERY = "clocks.sm,power.draw,enforced.power.limit,clocks_throttle_reasons.sw_power_cap"
# Drivers that do not know a field refuse the whole query: then the clock and power alone.
BASIC_QUERY = "clocks.sm,power.draw"


class Sample(NamedTuple):
    mhz: float
    watts: float
    limit_w: float | None = None  # the enforced power limit
    power_capped: bool | None = None  # the driver held the clock down to stay under that limit


def _number(field: str) -> float | None:
    try:
        return float(field)
    except ValueError:
        return None


def parse_sample(line: str) -> Sample | None:
    """One `--format=csv,noheader,nounits` line ("1500, 612.34, 700.00, Active", or the basic query's
    "1500, 612.34") -> a Sample; None for anything else. nvidia-smi prints "[N/A]" for a field the board
    does not report: a missing clock or power drops the line, a missing limit or flag is None."""
    fields = [f.strip() for f in line.split(",")]
    if len(fields) not in (2, 4):
        return None
    mhz, watts = _number(fields[0]), _number(fields[1])
    if mhz is None or watts is None:
        return None
    if len(fields) == 2:
        return Sample(mhz, watts)
    capped = {"Active": True, "Not Active": False}.get(fields[3])
    return Sample(mhz, watts, _number(fields[2]), capped)


def summarize(samples: list[Sample]) -> dict | None:
    if not samples:
        return None
    clocks, power = [s.mhz for s in samples], [s.watts for s in samples]
    out = {"sm_clock_mhz_mean": statistics.fmean(clocks), "sm_clock_mhz_min": min(clocks),
           "sm_clock_mhz_max": max(clocks), "power_w_mean": statistics.fmean(power), "clock_samples": len(samples)}
    limits = [s.limit_w for s in samples if s.limit_w is not None]
    if limits:
        out["power_limit_w"] = max(limits)
    flags = [s.power_capped for s in samples if s.power_capped is not None]
    if flags:
        out["power_capped_share"] = sum(flags) / len(flags)
    return out


class ClockSampler:
    """`with ClockSampler(device) as clock: ...` (or start() ... stop()), then `clock.summary()`: None when
    nothing was sampled, and `clock.unavailable` says why (no nvidia-smi, not a CUDA device, it exited)."""

    def __init__(self, device: torch.device, interval_ms: int = 100, smi: str = "nvidia-smi"):
        self.device, self.interval_ms, self.smi = device, interval_ms, smi
        self.samples: list[Sample] = []
        self._other_lines: list[str] = []  # what it printed that is not a sample (its errors)
        self.unavailable: str | None = None
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def _target(self) -> str:
        # The board torch's device index names may not be nvidia-smi's index (CUDA_VISIBLE_DEVICES): its UUID is.
        return f"GPU-{torch.cuda.get_device_properties(self.device).uuid}"

    def start(self) -> Self:
        if self.device.type != "cuda":
            self.unavailable = "not a CUDA device"
            return self
        path = shutil.which(self.smi)
        if path is None:
            self.unavailable = f"{self.smi} not found on PATH"
            return self
        target = self._target()
        self._proc = subprocess.Popen(
            [path, f"--query-gpu={self._query(path, target)}", "--format=csv,noheader,nounits", "-i", target,
             f"--loop-ms={self.interval_ms}"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)
        self._reader = threading.Thread(target=self._read, name="gpu-clock", daemon=True)
        self._reader.start()
        return self

    @staticmethod
    def _query(path: str, target: str) -> str:
        """QUERY if this driver's nvidia-smi answers it once, else BASIC_QUERY."""
        try:
            once = subprocess.run([path, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-i", target],
                                  check=False, capture_output=True, text=True, timeout=10,
                                  stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            return BASIC_QUERY
        return QUERY if once.returncode == 0 else BASIC_QUERY

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            sample = parse_sample(line)
            if sample is not None:
                self.samples.append(sample)
            elif line.strip() and len(self._other_lines) < 5:
                self._other_lines.append(line.strip())

    def stop(self) -> None:
        if self._proc is None:
            return
        exited = self._proc.poll()
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)
        if not self.samples:
            said = "; ".join(self._other_lines)[:200] or "no output"
            self.unavailable = f"{self.smi} exited {exited}: {said}" if exited is not None else f"{self.smi} printed no sample"

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def summary(self) -> dict | None:
        return summarize(self.samples)

    def describe(self) -> str:
        """One line for the run's output."""
        s = self.summary()
        if s is None:
            return f"SM clock: not sampled ({self.unavailable})"
        limit = f" of {s['power_limit_w']:.0f} W" if "power_limit_w" in s else ""
        capped = (f", held down by the power limit in {s['power_capped_share']:.0%} of them"
                  if "power_capped_share" in s else "")
        return (f"SM clock {s['sm_clock_mhz_mean']:,.0f} MHz mean (min {s['sm_clock_mhz_min']:,.0f}), "
                f"{s['power_w_mean']:.0f} W{limit}, {s['clock_samples']} samples{capped}")
