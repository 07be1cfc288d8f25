"""The T:D split advice: who waits for whom, and the split that moves the most micro-batches per second."""

import pytest
from dflash_trainer.config import ConfigError
from dflash_trainer.distributed import parallel
from dflash_trainer.distributed.parallel import SplitWindow, drafter_side_advice, split_advice, suggest_split
from dflash_trainer.distributed.sources import Wait
from dflash_trainer.train import explain


def test_suggest_split_maximises_the_slower_side():
    # The 8B shape on H200s: 96 ms per micro-batch on a target rank, 137 ms on a drafter rank.
    assert suggest_split(0.096, 0.137, 8) == (3, 5)  # min(3/0.096, 5/0.137) = 31.2/s beats 4:4 (29.2/s)
    assert suggest_split(0.096, 0.137, 2) == (1, 1)
    assert suggest_split(0.1, 0.1, 4) == (2, 2)
    assert suggest_split(0.1, 0.3, 4) == (1, 3)
    assert suggest_split(0.3, 0.1, 5) == (3, 2)  # 3:2 and 4:1 both move 10/s: the tie goes to fewer targets
    with pytest.raises(ValueError, match="at least 2 GPUs"):
        suggest_split(0.1, 0.1, 1)


def test_advice_names_the_idle_side_and_the_better_split():
    text = split_advice(0.096, 0.137, 5, 3)
    # supply 5 / 0.096 = 52.1/s, demand 3 / 0.137 = 21.9/s: ratio 2.38, targets idle 58%
    assert text.startswith("targets idle 58% (supply/demand 2.38: 96 ms per micro-batch on a target rank, 137 ms")
    assert text.endswith("for 8 GPUs try --target-gpus 3 --drafter-gpus 5 (+43% micro-batches/s)")
    stalled = split_advice(0.3, 0.1, 1, 3)  # supply 3.3/s, demand 30/s
    assert stalled.startswith("drafters wait 89% of the time for features")
    assert "try --target-gpus 3 --drafter-gpus 1" in stalled
    assert split_advice(0.096, 0.137, 3, 5).endswith("3:5 is the best split for 8 GPUs")


def test_drafter_side_infers_the_target_time_when_it_waits():
    # 4 steps of 2 micro-batches, 0.3 s each with 0.2 s stalled: 0.15 s wall and 0.05 s compute per
    # micro-batch; with 2 targets for 2 drafters the targets then take 0.15 s per micro-batch.
    text = drafter_side_advice([0.3] * 4, [0.2] * 4, 2, 2, 2)
    assert text.startswith("drafters wait 67% of the time for features (supply/demand 0.33: 150 ms per "
                           "micro-batch on a target rank, 50 ms on a drafter rank)")
    assert "try --target-gpus 3 --drafter-gpus 1" in text
    busy = drafter_side_advice([0.3] * 4, [0.01] * 4, 1, 5, 3)
    assert busy.startswith("drafters wait 3% of the time") and "the drafter ranks bound the run" in busy


def test_target_side_window_infers_the_drafter_time_when_targets_idle():
    window = SplitWindow(prefetch=2, length=4)  # measures batches 4..7
    intervals = [Wait(0.1) for _ in range(8)]
    assert [window.due(n) for n in range(1, 9)] == [False] * 7 + [True]
    window.t0 = 100.0
    # 4 batches in 1.2 s: 0.3 s each while the target needs 0.1 s: idle; drafters take 0.3 * 3 / 1 s each
    text = window.advice(intervals, 1, 3, now=101.2)
    assert text.startswith("targets idle 67% (supply/demand 3.00: 100 ms per micro-batch on a target rank, 900 ms")
    assert not window.due(8)  # once
    busy = SplitWindow(prefetch=2, length=4)
    busy.t0 = 0.0
    assert "the target ranks bound the run" in busy.advice(intervals, 1, 3, now=0.42)


def test_a_split_that_does_not_fit_is_a_config_error_at_its_source(monkeypatch):
    """The role checks raise ConfigError (exit 2) before any process group starts; any other ValueError of
    the start-up stays a fault (exit 1), not a config problem."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match=r"= 3, but the world has 2 processes"):
        parallel.init(2, 1, offline=False)
    with pytest.raises(ConfigError, match="drafter_ranks >= 1"):
        parallel.init(2, 0, offline=False)
    with pytest.raises(ConfigError, match="data.features_dir is set"):
        parallel.init(1, 1, offline=True)
    with pytest.raises(ConfigError, match="0 target ranks means offline mode"):
        parallel.init(0, 2, offline=False)
    assert explain(ConfigError("the split"))[0] == 2
    assert explain(ValueError("an internal fault"))[0] == 1
