"""When the loop saves and stops (mingpt/training/policy.py): the decision table, then the policy
over real flags in one process."""

import signal
import time

import pytest
import torch

from mingpt.runtime.exits import PreemptionFlag
from mingpt.training.policy import SavePolicy, decide

# step, last, every_steps, timed, preempted -> save, stop
TABLE = [
    (3, False, 0, False, False, False, False),  # nothing asked
    (10, False, 5, False, False, True, False),  # every 5 steps
    (11, False, 5, False, False, False, False),
    (7, True, 5, False, False, True, False),  # the last step always saves; it ends the run, not a stop
    (7, False, 0, True, False, True, False),  # the save interval elapsed
    (7, False, 5, False, True, True, True),  # a signal: save, then stop
    (10, True, 5, True, True, True, False),  # a signal at the last step: saved, and the run is done
]


@pytest.mark.parametrize("step,last,every_steps,timed,preempted,save,stop", TABLE)
def test_decision_table(step, last, every_steps, timed, preempted, save, stop):
    assert decide(step, last, every_steps, timed, preempted) == (save, stop)


def test_the_policy_saves_by_time_and_stops_on_a_signal():
    flag = PreemptionFlag()
    policy = SavePolicy(every_steps=0, every_s=1.0, preempt=flag, device=torch.device("cpu"))
    assert policy.after_step(1, last=False) == (False, False) and not policy.stop_requested()
    time.sleep(1.05)
    assert policy.after_step(2, last=False) == (True, False)
    policy.saved()  # the interval counts from the last save
    assert policy.after_step(3, last=False) == (False, False)
    flag.signum = signal.SIGUSR1  # what the handler records
    assert policy.stop_requested() and policy.after_step(4, last=False) == (True, True)
