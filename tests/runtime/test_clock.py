"""Where a run's time goes: stages that add up to the wall, parts moved between them, and the
closing line."""

from __future__ import annotations

import time

import pytest

from fmnist_flax.runtime.clock import START_UP, StageClock


def test_the_stages_add_up_to_the_wall_from_the_commands_start():
    clock = StageClock(since=time.perf_counter() - 0.2)  # started 0.2 s ago
    time.sleep(0.05)
    clock.stage("data")
    time.sleep(0.1)
    clock.stage("training")
    time.sleep(0.1)
    clock.move(0.04, "training", "evaluations")
    clock.move(99, "data", "compilation")  # at most what the stage has
    totals = clock.totals()
    assert list(totals) == [START_UP, "data", "training", "evaluations", "compilation"]
    assert totals[START_UP] >= 0.25 and totals["data"] == 0.0
    assert totals["evaluations"] == pytest.approx(0.04) and totals["compilation"] >= 0.1
    assert sum(totals.values()) == pytest.approx(clock.wall(), abs=0.01)


def test_the_closing_line_names_the_larger_stages():
    clock = StageClock()
    clock.stage("training")
    time.sleep(0.2)
    clock.stage("report")
    time.sleep(0.001)  # under the share the line shows
    line = clock.line()
    assert line.startswith("time 0.2 s: training 0.2") and "report" not in line
