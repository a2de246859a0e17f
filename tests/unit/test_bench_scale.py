"""The replica scale benches' reading of the members' log lines and step records
(benchmarks/survivors_scale.py) and the membership sim's layout (benchmarks/membership_sim.py)."""

import pytest

from benchmarks import free_port
from benchmarks.__main__ import main
from benchmarks.membership_sim import epochs_in, layout, quorum
from benchmarks.survivors_scale import beacon_lines, epoch_lines, epochs_of, stat, step_time, step_work, work_figures

# each group's console log, as a 4-group job whose group 0 (the coordinator) was SIGKILLed after step 31 writes it
LOGS = "".join(f"15:45:19 vm:0 [rank 0/1] INFO mingpt.replicas: {line}\n" for line in [
    "replica epoch 0: groups [0, 1, 2, 3] (this is group 0, rank 0), formed in 0.04 s (its links 0.01 s)",
    "replica epoch 2: groups [0, 1, 2, 3] (this is group 0, rank 0), formed in 0.19 s (its links 0.01 s)",
    "replica beacon of group 0: 2 channels at the end; sent 627 messages (54186 bytes) in 21.5 s",
    "replica epoch 0: groups [0, 1, 2, 3] (this is group 1, rank 1), formed in 0.50 s (its links 0.00 s)",
    "replica epoch 0 ended at step 31: group 0 lost (its connection closed); the next epoch trains the step again",
    "replica epoch 1: groups [1, 2, 3] (this is group 1, rank 0), formed in 0.05 s (its links 0.05 s; the last "
    "request, group 3's, came 0.01 s in; formed by its beacon before its trainer asked)",
    "replica epoch 2: groups [0, 1, 2, 3] (this is group 1, rank 1), formed in 0.01 s (its links 0.00 s)",
    "replica beacon of group 1: 3 channels at the end; sent 900 messages (81900 bytes) in 30.0 s",
    "replica epoch 0: groups [0, 1, 2, 3] (this is group 2, rank 2), formed in 0.51 s (its links 0.01 s)",
    "replica epoch 1: groups [1, 2, 3] (this is group 2, rank 1), formed in 0.01 s (its links 0.00 s)",
    "replica beacon of group 2: 6 channels at the end; sent 843 messages (81550 bytes) in 31.0 s",
    "replica epoch 0: groups [0, 1, 2, 3] (this is group 3, rank 3), formed in 0.36 s (its links 0.01 s)",
    "replica epoch 1: groups [1, 2, 3] (this is group 3, rank 2), formed in 0.05 s (its links 0.04 s)",
    "replica beacon of group 3: 4 channels at the end; sent 841 messages (81402 bytes) in 30.9 s",
])

# k = 3 shares a group: a fault-free step, each group its own 3; the step after group 0 was lost, its
# shares 0, 1 and 2 dealt to groups 1, 2 and 3 ([group that trained it, samples, ids] per share)
WHOLE = [[g, 3, 100 + s] for s, g in enumerate([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3])]
AFTER = [[g, 3, 100 + s] for s, g in enumerate([1, 2, 3, 1, 1, 1, 2, 2, 2, 3, 3, 3])]
TRAIN = [{"kind": "train", "step": s, "time": 100 + 0.1 * s, "members": [0, 1, 2, 3], "shares": WHOLE}
         for s in range(1, 32)] + [{"kind": "train", "step": 32, "time": 103.6, "members": [1, 2, 3], "shares": AFTER}]


def test_each_groups_last_beacon_line_gives_its_channels_and_what_it_sent_a_second():
    got = beacon_lines(LOGS)
    assert sorted(got) == [0, 1, 2, 3]
    assert got[1] == {"channels": 3, "msgs_per_s": 30.0, "bytes_per_s": 2730.0}
    assert got[0]["msgs_per_s"] == pytest.approx(627 / 21.5)
    # a killed incarnation logs no such line: the restarted one's (the last) is the group's
    assert beacon_lines(LOGS.replace("627 messages", "1 messages") + LOGS)[0]["msgs_per_s"] == pytest.approx(627 / 21.5)


def test_epoch_lines_give_their_groups_and_formation_times():
    lines = epoch_lines(LOGS)
    assert len(lines) == 9
    assert lines[3] == {"number": 1, "groups": [1, 2, 3], "group": 1, "rank": 0, "formed_s": 0.05, "links_s": 0.05,
                        "last_request": [3, 0.01], "ahead": True}  # (the coordinator's line says whose request
    assert lines[4]["last_request"] is None and not lines[4]["ahead"]  # came last, and whether its beacon formed it)


def test_the_first_epoch_and_the_survivors_epoch_after_the_kill():
    got = epochs_of(epoch_lines(LOGS), killed=0, groups=4)
    assert got["first_epoch"] == {"number": 0, "groups": 4,
                                  "formed_s": {"median": 0.43, "max": 0.51, "max_member": 2},
                                  "links_s": {"median": 0.01, "max": 0.01, "max_member": 0}, "last_request": None,
                                  "formed_ahead": False}
    after = got["epoch_after_kill"]
    assert after["number"] == 1 and after["groups"] == 3
    assert after["formed_s"] == {"median": 0.05, "max": 0.05, "max_member": 1}  # (the lowest on a tie)
    assert after["links_s"] == {"median": 0.04, "max": 0.05, "max_member": 1}
    assert after["last_request"] == {"group": 3, "came_s": 0.01} and after["formed_ahead"]
    assert "epoch_after_kill" not in epochs_of(epoch_lines(LOGS), killed=None, groups=4)
    assert "first_whole_epoch" not in got


def test_where_a_group_started_too_late_for_the_first_epoch_the_first_of_all_groups_is_given_too():
    # epoch 0 without group 2 (its line gone), epoch 1 without group 0, epoch 2 of all 4
    late = epoch_lines(LOGS.replace("epoch 0: groups [0, 1, 2, 3]", "epoch 0: groups [0, 1, 3]"))
    got = epochs_of([e for e in late if (e["number"], e["group"]) != (0, 2)], killed=None, groups=4)
    assert got["first_epoch"]["number"] == 0 and got["first_epoch"]["groups"] == 3
    assert got["first_whole_epoch"]["number"] == 2 and got["first_whole_epoch"]["groups"] == 4


@pytest.mark.parametrize(("shares", "groups", "want"), [
    (WHOLE, 4, {0: (3, 1), 1: (3, 1), 2: (3, 1), 3: (3, 1)}),
    (AFTER, 4, {1: (4, 2), 2: (4, 2), 3: (4, 2)}),  # each survivor: one orphan share, one more copy
    ([[1, 3, 0], [1, 3, 1], [1, 3, 2], [1, 3, 3]], 2, {1: (4, 3)}),  # a survivor of 2 with k = 2: both of the other's
])
def test_passes_and_gradient_copies_per_group_from_a_steps_shares(shares, groups, want):
    assert step_work(shares, groups) == want


def test_work_and_step_time_are_read_at_the_last_whole_step_before_the_kill_and_the_step_after_it():
    got = work_figures(TRAIN, 4, t=103.2)
    assert got["passes"] == {"fault_free": {"step": 31, "median": 3, "max": 3, "max_member": 0},
                             "after_kill": {"step": 32, "median": 4, "max": 4, "max_member": 1}}
    assert got["grad_copies"]["after_kill"] == {"step": 32, "median": 2, "max": 2, "max_member": 1}
    assert step_time(TRAIN, t=103.2) == pytest.approx(0.1)
    assert "after_kill" not in work_figures(TRAIN, 4, t=None)["passes"]


def test_stat_names_the_member_with_the_max():
    assert stat({0: 16, 1: 16, 2: 16, 3: 17}, 1) == {"median": 16.0, "max": 17, "max_member": 3}
    assert stat({}) is None


def test_the_sim_gives_the_coordinator_and_its_successors_processes_of_their_own_and_deals_out_the_rest():
    """The rest dealt out in turn, so that each process holds members of every level of the tree (split by
    number, one process held every relay of a level, its one reactor passing up hundreds of members' beats)."""
    assert layout(1024, 10, 128) == [range(0, 1), range(1, 2), range(2, 10), range(10, 12),
                                     *(range(12 + i, 1024, 8) for i in range(8))]
    assert [len(r) for r in layout(32, 10, 128)] == [1, 1, 8, 2, 20]
    assert layout(16, 1, 128) == [range(0, 1), range(1, 3), range(3, 16)]
    relays = range(12, 1024 // 6)  # (fan_out 6: the members with members below them, but the lost ones)
    assert all(sum(m in relays for m in r) in (19, 20) for r in layout(1024, 10, 128)[4:])
    assert sorted(m for r in layout(1000, 10, 40) for m in r) == list(range(1000))
    assert quorum(1024, 10) == 513 and quorum(16, 10) == 6  # a majority, or the survivors where they are fewer


def test_the_sim_counts_the_epochs_formed_in_its_window_apart_from_the_members_takes_of_them():
    """A new epoch is a take by each of its members: 3,283 takes of 2,048 members in the window were one or
    two epochs, and the line said only the takes."""
    takes = [(0.5, 3)] * 4 + [(1.2, 4)] * 4 + [(1.9, 5)] * 3 + [(2.5, 5)] + [(3.5, 6)] * 4  # 4 members
    assert epochs_in(takes, 1.0, 3.0) == {"epochs_taken_in_window": 8, "epochs_formed_in_window": 2}
    assert epochs_in(takes[:4], 1.0, 3.0) == {"epochs_taken_in_window": 0, "epochs_formed_in_window": 0}


@pytest.mark.parametrize(("argv", "said"), [
    (["survivors-scale", "--groups", "1", "4"], "--groups [1, 4]: replica groups come 2 or more to a job"),
    (["membership-sim", "--members", "8"], "--members [8]: at least --lose 10 + 2"),
])
def test_the_benches_go_by_their_dashed_names_and_a_bad_size_gets_one_line(argv, said, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and said in capsys.readouterr().err


def test_the_port_picker_never_gives_one_port_twice():
    """The tests' and benches' `free_port`: the kernel may hand out the same free port on two calls in a
    row, and two beacons given one port waited for each other's without end (a CI run hung so)."""
    ports = [free_port() for _ in range(3000)]
    assert len(set(ports)) == len(ports)
