"""The GPU's SM clock and board power while a benchmark runs, sampled by nvidia-smi in the background.

Why the benchmark reports them: MFU is measured against the datasheet's dense bf16 peak, which an
H100/H200 reaches at 1,830 MHz (132 SMs x 4,096 FLOP per SM per clock), and these GPUs hold that clock
only in bursts. On an H200, GEMMs run back to back settle near 1,500 MHz at 610-670 W and 660-690
TFLOP/s; the same GEMMs with idle gaps between them run at 1,975 MHz and 715-790 TFLOP/s. So part of
the distance between a step's MFU and 100% is the clock the board sustains, and runs of the same code
differ with it between machines. nvidia-smi rather than NVML's Python binding: it ships with the
driver userspace of every GPU host and container, the binding is not in the frozen environment.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
from typing import Self

import torch

QUERY = "clocks.sm,power.draw"


def parse_sample(line: str) -> tuple[float, float] | None:
    """One `--format=csv,noheader,nounits` line ("1500, 612.34") -> (MHz, W); None for anything else
    (nvidia-smi prints "[N/A]" for a field the board does not report)."""
    fields = [f.strip() for f in line.split(",")]
    if len(fields) != 2:
        return None
    try:
        return float(fields[0]), float(fields[1])
    except ValueError:
        return None


def summarize(samples: list[tuple[float, float]]) -> dict | None:
    if not samples:
        return None
    clocks, power = [c for c, _ in samples], [p for _, p in samples]
    return {"sm_clock_mhz_mean": statistics.fmean(clocks), "sm_clock_mhz_min": min(clocks),
            "sm_clock_mhz_max": max(clocks), "power_w_mean": statistics.fmean(power), "clock_samples": len(samples)}


class ClockSampler:
    """`with ClockSampler(device) as clock: ...` (or start() ... stop()), then `clock.summary()`: None when
    nothing was sampled, and `clock.unavailable` says why (no nvidia-smi, not a CUDA device, it exited)."""

    def __init__(self, device: torch.device, interval_ms: int = 100, smi: str = "nvidia-smi"):
        self.device, self.interval_ms, self.smi = device, interval_ms, smi
        self.samples: list[tuple[float, float]] = []
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
        self._proc = subprocess.Popen(
            [path, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-i", self._target(),
             f"--loop-ms={self.interval_ms}"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)
        self._reader = threading.Thread(target=self._read, name="gpu-clock", daemon=True)
        self._reader.start()
        return self

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
        return (f"SM clock {s['sm_clock_mhz_mean']:,.0f} MHz mean (min {s['sm_clock_mhz_min']:,.0f}), "
                f"{s['power_w_mean']:.0f} W, {s['clock_samples']} samples")
