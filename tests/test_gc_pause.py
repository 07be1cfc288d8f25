"""gc_pause: the collector is off inside, frozen and back as it was after; the entry points import under it."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest
from dflash_trainer.infra.gc_pause import gc_paused


def test_paused_inside_then_frozen_and_enabled_again():
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    made = []
    try:
        with gc_paused():
            assert not gc.isenabled()
            made.append([[] for _ in range(1000)])  # lists: tracked by the collector, so freeze counts them
        assert gc.isenabled()
        assert gc.get_freeze_count() >= frozen + 1000  # what the block made is out of the collector's sight
    finally:
        gc.unfreeze()


def test_a_collector_that_was_off_stays_off_and_an_error_still_restores():
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()
    try:
        with gc_paused():
            raise KeyError("inside")
    except KeyError:
        pass
    finally:
        gc.unfreeze()
    assert gc.isenabled()


# A Python that imports torch and transformers per entry point: test-fast checks the trainer's, the slow
# tests the other two.
@pytest.mark.parametrize("entry_point", ["dflash_trainer.train",
                                         pytest.param("dflash_trainer.eval.cli", marks=pytest.mark.slow),
                                         pytest.param("dflash_trainer.regenerate.cli", marks=pytest.mark.slow)])
def test_each_entry_point_imports_with_the_collector_paused_and_leaves_it_on(entry_point):
    code = (f"import gc, {entry_point}; "
            "print(gc.isenabled(), gc.get_freeze_count() > 100_000)")  # torch + transformers: ~10^5-10^6 objects
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True"]
