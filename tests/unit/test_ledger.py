"""The time ledger: every second of a process in exactly one state."""

import os
import time

from mingpt.training.ledger import STATES, Ledger, mean_record, process_start_epoch


def test_process_start_is_read_from_proc_and_precedes_now():
    start = process_start_epoch()
    age = time.time() - start
    assert 0 < age < time.monotonic() + 1  # this process is younger than the machine's clock
    # a process just started is a few hundredths of a second old
    assert process_start_epoch(os.getpid()) == start or abs(process_start_epoch(os.getpid()) - start) < 0.05


def test_states_add_up_to_the_process_age_and_the_first_step_is_start_up():
    ledger = Ledger(start_epoch=time.time() - 2.0)  # started 2 s ago: that is its launch
    ledger.switch("config")
    time.sleep(0.02)
    ledger.switch("step_data")  # before started(): counts as the first step
    time.sleep(0.02)
    ledger.switch("step_compute")
    time.sleep(0.02)
    ledger.started()
    ledger.switch("step_compute")
    time.sleep(0.03)
    with ledger.during("eval"):
        time.sleep(0.02)
    assert ledger.state == "step_compute"
    totals = dict(zip(STATES, ledger.totals()))
    age = time.time() - ledger.start_epoch
    assert abs(sum(totals.values()) - age) < 0.01
    assert 1.99 < totals["launch"] < 2.05
    assert totals["first_step"] >= 0.04 and totals["step_data"] == 0
    assert 0.03 <= totals["step_compute"] < 0.1 and 0.02 <= totals["eval"] < 0.1


def test_mean_record_averages_ranks():
    n = len(STATES)
    rec = mean_record([[100.0] + [1.0] * n, [102.0] + [3.0] * n])
    assert rec["t0"] == 101.0 and set(rec["s"]) == set(STATES) and all(v == 2.0 for v in rec["s"].values())
