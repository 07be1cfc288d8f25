"""gpu_clock: nvidia-smi's CSV samples -> the bench's clock and power figures, and the sampler's lifecycle.

The sampler runs here against a stand-in `nvidia-smi` (a script printing the lines the real one prints
with `--format=csv,noheader,nounits`); tests/test_gpu.py runs it against the real one on a GPU."""

import stat
import sys
import time

import pytest
import torch
from dflash_trainer.infra.gpu_clock import BASIC_QUERY, QUERY, ClockSampler, Sample, parse_sample, summarize


@pytest.mark.parametrize("line, expected", [
    ("1455, 694.20, 700.00, Active\n", Sample(1455.0, 694.2, 700.0, True)),
    ("1980, 75.10, 700.00, Not Active", Sample(1980.0, 75.1, 700.0, False)),
    ("1500, 612.34, [N/A], [N/A]", Sample(1500.0, 612.34, None, None)),
    ("1500, 612.34\n", Sample(1500.0, 612.34)), ("1980, 75.10", Sample(1980.0, 75.1)),
    ("1500, [N/A]", None), ("[N/A], 600, 700, Active", None), ("", None), ("No devices were found", None),
    ("1, 2, 3", None)])
def test_parse_sample_reads_nvidia_smis_csv_and_skips_anything_else(line, expected):
    assert parse_sample(line) == expected


def test_summarize_gives_clock_power_the_limit_and_how_often_the_limit_held_the_clock():
    s = summarize([Sample(1500.0, 690.0, 700.0, True), Sample(1700.0, 640.0, 700.0, False),
                   Sample(1600.0, 620.0, 700.0, True), Sample(1600.0, 650.0, 700.0, True)])
    assert s == {"sm_clock_mhz_mean": 1600.0, "sm_clock_mhz_min": 1500.0, "sm_clock_mhz_max": 1700.0,
                 "power_w_mean": 650.0, "clock_samples": 4, "power_limit_w": 700.0, "power_capped_share": 0.75}
    # A board (or driver) that reports neither: the clock and power alone, no made-up share.
    assert summarize([Sample(1500.0, 600.0), Sample(1700.0, 640.0, None, None)]) == {
        "sm_clock_mhz_mean": 1600.0, "sm_clock_mhz_min": 1500.0, "sm_clock_mhz_max": 1700.0,
        "power_w_mean": 620.0, "clock_samples": 2}
    assert summarize([]) is None


def _standin(tmp_path, body: str):
    path = tmp_path / "nvidia-smi"
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_sampler_collects_the_lines_it_is_sent_and_stops_the_loop(tmp_path, monkeypatch):
    args_file = tmp_path / "args"
    smi = _standin(tmp_path, f"""import sys, time
if not any(a.startswith("--loop-ms") for a in sys.argv):  # the sampler's one probe of the query
    print("1980, 80.0, 700.00, Not Active")
    sys.exit(0)
open({str(args_file)!r}, "w").write(" ".join(sys.argv[1:]))
for clock, capped in ((1500, "Active"), (1600, "Not Active"), (1700, "Not Active")):
    print(f"{{clock}}, 600.5, 700.00, {{capped}}", flush=True)
print("[N/A], [N/A], [N/A], [N/A]", flush=True)
time.sleep(60)  # the real one loops until it is stopped
""")
    monkeypatch.setattr(ClockSampler, "_target", lambda self: "GPU-0000")
    sampler = ClockSampler(torch.device("cuda", 0), smi=smi)
    with sampler:
        for _ in range(250):  # until the stand-in's three samples are read (5 s at most)
            if len(sampler.samples) == 3:
                break
            time.sleep(0.02)
    assert sampler._proc.poll() is not None  # stopped, not left looping
    assert sampler.summary()["sm_clock_mhz_mean"] == 1600.0 and sampler.unavailable is None
    assert sampler.describe() == ("SM clock 1,600 MHz mean (min 1,500), 600 W of 700 W, 3 samples, "
                                  "held down by the power limit in 33% of them")
    assert args_file.read_text() == (f"--query-gpu={QUERY} --format=csv,noheader,nounits -i GPU-0000 "
                                     "--loop-ms=100")


def test_a_driver_that_refuses_the_power_cap_fields_still_gives_the_clock(tmp_path, monkeypatch):
    # nvidia-smi refuses a whole query naming a field it does not know; the sampler falls back to the clock
    # and power it had before.
    args_file = tmp_path / "args"
    smi = _standin(tmp_path, f"""import sys, time
if "enforced.power.limit" in " ".join(sys.argv):
    print('Field "enforced.power.limit" is not a valid field to query.')
    sys.exit(2)
open({str(args_file)!r}, "w").write(" ".join(sys.argv[1:]))
for clock in (1500, 1700):
    print(f"{{clock}}, 600.5", flush=True)
time.sleep(60)
""")
    monkeypatch.setattr(ClockSampler, "_target", lambda self: "GPU-0000")
    sampler = ClockSampler(torch.device("cuda", 0), smi=smi)
    with sampler:
        for _ in range(250):
            if len(sampler.samples) == 2:
                break
            time.sleep(0.02)
    assert args_file.read_text().startswith(f"--query-gpu={BASIC_QUERY} ")
    assert sampler.describe() == "SM clock 1,600 MHz mean (min 1,500), 600 W, 2 samples"


def test_sampler_says_why_it_has_nothing(tmp_path, monkeypatch):
    cpu = ClockSampler(torch.device("cpu"))
    with cpu:
        pass
    assert cpu.summary() is None and cpu.unavailable == "not a CUDA device"
    assert cpu.describe() == "SM clock: not sampled (not a CUDA device)"

    missing = ClockSampler(torch.device("cuda", 0), smi=str(tmp_path / "no-such-nvidia-smi"))
    with missing:
        pass
    assert missing.summary() is None and "not found on PATH" in missing.unavailable

    monkeypatch.setattr(ClockSampler, "_target", lambda self: "GPU-0000")
    failing = ClockSampler(torch.device("cuda", 0),
                           smi=_standin(tmp_path, 'import sys\nprint("No devices were found", file=sys.stderr)\nsys.exit(6)\n'))
    with failing:
        time.sleep(0.5)
    assert failing.summary() is None and failing.unavailable.endswith("exited 6: No devices were found")
