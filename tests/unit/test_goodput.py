"""Goodput accounting (mingpt/report/goodput.py) from records. The report of a real SIGKILLed run is
scenarios/test_report_of_a_faulted_run.py."""

import pytest
from conftest import ledger

from mingpt.report.goodput import CATEGORIES, account


def test_account_of_two_restarts_and_a_second_job():
    records = [
        # start A: a new run; killed after step 20; the snapshot of step 10 is resumed
        ledger(1000, 0, "start", launch=2, model=1),
        ledger(1000, 10, launch=2, model=1, first_step=1, step_compute=8, step_data=1, snapshot=0.5, log=0.5),
        {"kind": "train", "step": 20, "loss": 1.0},
        ledger(1000, 20, launch=2, model=1, first_step=1, step_compute=16, step_data=2, snapshot=1, log=1),
        # start B, 2 s after A's last record: a warm restart from step 10, to the end (step 30)
        ledger(1026, 10, "start", launch=0.1, config=0.2, process_group=0.2, restore=0.5),
        ledger(1026, 30, launch=0.1, config=0.2, process_group=0.2, restore=0.5, first_step=0.5, step_compute=15,
               step_data=1, log=0.5),
        # start C: the same command run again much later (another job): nothing left to train
        ledger(5000, 30, "start", job="j2", launch=1, config=1),
    ]
    acc = account(records)
    assert [a.first_step for a in acc.attempts] == [0, 10, 30]
    assert acc.gaps == [0.0, pytest.approx(2.0), 0.0]  # the hours between the two jobs are not the job's
    expected = {"training": 8 + 15, "data_wait": 1 + 1, "lost": 18 - 9, "down": 2, "startup": 4 + 1.5 + 2,
                "snapshot": 1, "eval": 0, "log": 1.5, "regroup": 0, "other": 0}
    assert {c: pytest.approx(v) for c, v in expected.items()} == acc.seconds
    assert acc.wall == pytest.approx(24 + 2 + 18 + 2)
    assert sum(acc.seconds[c] for c in CATEGORIES) == pytest.approx(acc.wall)
    assert acc.goodput == pytest.approx(23 / 46)
    assert acc.lost_steps == [10, 0, 0]


def test_account_of_replica_groups():
    """Replica groups: the wall clock from the first start; training kept at the time each kept step took
    (a step a survivor trained two shares of included); the step in flight at a fault lost, the rest of
    the pause the regroup."""
    train = lambda step, ms, t: {"kind": "train", "step": step, "step_ms": ms, "time": t}  # noqa: E731
    records = [
        ledger(100, 0, "start", launch=3, model=2, group=0),
        ledger(101, 0, "start", launch=3, model=1, group=1),
        {"kind": "epoch", "step": 0, "why": "start", "regroup_s": 0.01, "groups": [0, 1], "healed": [], "time": 105},
        *[train(s, 100, 105 + 0.1 * s) for s in range(1, 11)],
        {"kind": "epoch", "step": 10, "why": "group 1 lost", "regroup_s": 0.2, "groups": [0], "healed": [], "time": 107},
        train(11, 300, 107.5),  # one member trains both shares
        train(12, 100, 109),
        train(12, 100, 110),  # step 12 logged again: the last record of a step wins
    ]
    acc = account(records)
    assert acc.wall == pytest.approx(10)
    # the fault: the step in flight (at most one step, 0.1 s) lost out of the 1 s pause, 0.2 s regroup
    expected = dict.fromkeys(CATEGORIES, 0.0) | {"training": 1.4, "regroup": 0.2, "startup": 5, "lost": 0.1,
                                                 "other": 10 - 1.4 - 0.2 - 5 - 0.1}
    assert {c: pytest.approx(v) for c, v in expected.items()} == acc.seconds
    assert acc.goodput == pytest.approx(0.14) and acc.faults == 1


def test_a_snapshot_older_than_the_previous_start_loses_the_steps_of_both_starts():
    records = [
        ledger(0, 0, "start"),
        ledger(0, 20, step_compute=20),  # A: steps 1-20, snapshots at 10 and 20
        ledger(30, 20, "start"),
        ledger(30, 25, step_compute=5),  # B: resumed at 20, killed at 25
        ledger(40, 10, "start"),  # C: the snapshot of step 20 was damaged: back to 10
        ledger(40, 30, step_compute=20),
    ]
    acc = account(records)
    # A keeps steps 1-10 (interpolated: 10 s), B keeps nothing, C keeps 11-30
    assert acc.seconds["training"] == pytest.approx(10 + 0 + 20)
    assert acc.seconds["lost"] == pytest.approx(10 + 5)
    assert acc.lost_steps == [10, 5, 0]
