"""What the report says of faults and resumes: the restarts counted once, and the same in the summary
and the plots; the steps in flight of a replica job; the time axes without the idle time between jobs;
the throughput plot scaled to its steady points."""

import re

import matplotlib.colors
import pytest
from conftest import ledger

from mingpt.report import html
from mingpt.report.summary import Run, summary


def start(t0, step, group=None, launch="secret-derived", job="torchrun-1", restart=0, **seconds):
    """A process's start record (a replica group's torchrun: its job id, and its restart count; its
    world is its group's, one process)."""
    rec = {**ledger(t0, step, "start", model=1, **seconds), "launch_id": launch, "job_id": job, "restart": restart}
    return rec if group is None else {**rec, "group": group, "world_size": 1, "parallel": "single"}


def train(step, t, ms=100.0, tok_s=1000.0):
    return {"kind": "train", "step": step, "step_ms": ms, "time": t, "tokens_per_s": tok_s, "mfu": tok_s / 1e5,
            "loss": 1.0, "tokens_seen": 100 * step}


def epoch(step, t, why, regroup_s, healed=(), members=(0, 1, 2)):
    return {"kind": "epoch", "step": step, "time": t, "why": why, "regroup_s": regroup_s, "members": list(members),
            "healed": list(healed)}


def replica_job():
    """Three groups of one mingpt-torchrun each (one launch id, derived from the job secret). Group 0's
    process is SIGKILLed in step 21; its torchrun restarts it and it heals to step 30, then leads."""
    return [
        *[start(100, 0, g) for g in range(3)],
        epoch(0, 105, "start", 0.01),
        *[train(s, 105 + 0.1 * s) for s in range(1, 21)],
        epoch(20, 107.35, "group 0 lost", 0.25, members=(1, 2)),  # 0.1 s of the step in flight, then the regroup
        *[train(s, 107.35 + 0.15 * (s - 20), ms=150) for s in range(21, 31)],  # two survivors, three shares each
        start(108, 30, 0, restart=1, regroup=0.3),  # the restarted process's start record, once it healed: its step
        epoch(30, 109.0, "start", 1.0, healed=[0]),  # written by group 0, who waited 1 s to be let in
        *[train(s, 109 + 0.1 * (s - 30)) for s in range(31, 41)],
    ]


def test_a_replica_job_counts_a_restart_per_process_started_again_and_its_step_in_flight_lost():
    run = Run.of(replica_job())
    out = summary(run, "r")
    # each start's world is its group's (1 process): "world size 1 single" said the job was one process
    assert "starts 4 (1 restart, 3 groups)   1 process per group, replicas across the groups" in out, out
    assert "world size" not in out, out
    assert "group 0: back at step 30" in out, out
    assert "(model 1.0 | joining and healing 0.3)" in out, out  # where its return went
    acc = run.account
    expected = {"training": 2 + 1.5 + 1, "lost": 0.1, "regroup": 0.25 + 0.15, "startup": 5, "other": 0}
    assert {c: pytest.approx(acc.seconds[c], abs=1e-6) for c in expected} == expected
    assert acc.wall == pytest.approx(10) and acc.goodput == pytest.approx(0.45)


def test_a_group_killed_before_it_wrote_its_start_counts_its_restart_all_the_same():
    """Group 0's first process was SIGKILLed while it joined, before its start record: the record of its
    torchrun's restart 1 is the group's first, and still a restart (the report said "0 restarts")."""
    records = [r for r in replica_job() if not (r.get("kind") == "start" and r.get("group") == 0 and r["restart"] == 0)]
    out = summary(Run.of(records), "r")
    assert "starts 3 (1 restart, 3 groups)" in out, out


def test_a_replica_groups_restart_is_marked_with_its_group_in_the_plots(monkeypatch):
    """A group's restart in the loss plot says which group, not its torchrun's world ("ws 1")."""
    monkeypatch.setattr(html, "_figure", lambda fig, *args: fig)
    labels = [t.get_text().strip() for ax in html.loss_figure(Run.of(replica_job())).axes for t in ax.texts]
    assert "group 0" in labels and not any(label.startswith("ws") for label in labels), labels


def test_groups_of_two_processes_count_a_start_and_a_heal_per_group_not_per_process():
    """Three groups of two processes (members 2g and 2g + 1), each process writing its start record;
    group 1's torchrun restarts both, which heal together: one restart, one group healed."""
    both = lambda t0, step, g, **kw: [{**start(t0 + 0.01 * i, step, g, job=f"torchrun-{g}", **kw),  # noqa: E731
                                       "world_size": 2, "parallel": "fsdp"} for i in range(2)]
    records = [
        *[r for g in range(3) for r in both(100, 0, g)],
        {**epoch(0, 105, "start", 0.01), "procs": 2},
        *[train(s, 105 + 0.1 * s) for s in range(1, 21)],
        {**epoch(20, 107.35, "group 1 process 1 lost", 0.25), "procs": 2},
        *[train(s, 107.35 + 0.15 * (s - 20), ms=150) for s in range(21, 31)],
        *both(108, 30, 1, restart=1, regroup=0.3),
        {**epoch(30, 109.0, "a group joins", 0.2, healed=[2, 3]), "procs": 2},
        *[train(s, 109 + 0.1 * (s - 30)) for s in range(31, 41)],
    ]
    out = summary(Run.of(records), "r")
    assert "starts 4 (1 restart, 3 groups)   2 processes per group, fsdp inside each, replicas across the groups" in out, out
    assert "1 lost a group (each lost at most its step in flight), 1 group(s) healed from a peer" in out, out
    assert out.count("group 1: back at step 30") == 1, out


def test_a_group_that_left_on_a_stop_signal_is_no_fault_and_no_step_lost_and_its_return_no_restart():
    """Group 2's torchrun got SIGTERM: it left after step 20, the others formed an epoch without it at the
    step boundary (nothing dropped): its regroup is counted, no step in flight lost, no group lost. The
    same command brought it back (a new torchrun): a resume, as a job's after Ctrl-C, not a restart. Group
    0's process, SIGKILLed later and started again by another command, is one."""
    records = [
        *[start(100, 0, g) for g in range(3)],
        epoch(0, 105, "start", 0.01),
        *[train(s, 105 + 0.1 * s) for s in range(1, 21)],
        epoch(20, 107.05, "group 2 left the job (a stop signal)", 0.05, members=(0, 1)),
        *[train(s, 107.05 + 0.15 * (s - 20), ms=150) for s in range(21, 31)],
        start(108, 30, 2, job="torchrun-2", regroup=0.3),
        epoch(30, 108.6, "start", 0.3, healed=[2]),
        *[train(s, 108.6 + 0.1 * (s - 30)) for s in range(31, 41)],
        epoch(40, 109.8, "group 0 lost", 0.2, members=(1, 2)),
        start(110, 40, 0, job="torchrun-3", regroup=0.3),
        epoch(40, 110.6, "start", 0.3, healed=[0]),
    ]
    left = Run.of(records[:27])  # to step 30, group 2 away
    assert left.account.seconds["lost"] == 0 and left.account.seconds["regroup"] == pytest.approx(0.05)
    run = Run.of(records)
    out = summary(run, "r")
    assert "5 epochs, 1 lost a group (each lost at most its step in flight), 2 group(s) healed from a peer, groups " \
           "left 1 time(s) on a stop signal" in out, out
    assert "starts 5 (1 restart, 3 groups)" in out, out
    assert run.account.restarts == [4] and run.account.lost_at == {4: 109.8}


def test_a_resume_by_another_job_is_no_restart_in_the_summary_nor_in_the_plots(monkeypatch):
    """Ctrl-C, then the same command an hour later: two jobs, no restart; and the hour is not the job's."""
    monkeypatch.setattr(html, "_figure", lambda fig, *args: fig)
    run = Run.of([start(1000, 0, launch="a"), train(10, 1010), ledger(1000, 10, step_compute=10),
                  start(4600, 10, launch="b"), train(20, 4610), ledger(4600, 20, step_compute=10)])
    assert "starts 2 (0 restarts, 2 jobs)" in summary(run, "r")
    loss = html.loss_figure(run)
    dashed = [line for ax in loss.axes for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert not dashed  # no restart marked; the new job is a dotted line
    ax = html.throughput_figure(run).axes[0]
    assert max(ax.get_lines()[0].get_xdata()) < 1  # minutes of the job's time, not the hour between


def test_a_point_far_above_the_rest_does_not_flatten_the_throughput_plot(monkeypatch):
    monkeypatch.setattr(html, "_figure", lambda fig, *args: fig)
    records = [start(100, 0), *[train(s, 100 + s, tok_s=1000 + s) for s in range(1, 50)],
               train(50, 150, tok_s=265451)]  # a rate measured over a wrong interval
    ax = html.throughput_figure(Run.of(records)).axes[0]
    assert ax.get_ylim()[1] <= 3.2 * 1025


def test_a_groups_restart_is_drawn_in_its_groups_lane_while_the_others_train(monkeypatch):
    """Group 0's restart (lost at 107.35, started again at 108, back at 109.3) is group 0's: its lane shows
    the restart and the start-up, the other groups' lanes train straight through it (it was drawn as a
    start-up of the whole job)."""
    monkeypatch.setattr(html, "_figure", lambda fig, *args: fig)
    timeline = html.goodput_figure(Run.of(replica_job())).axes[1]
    lanes = {t.get_text(): y for t, y in zip(timeline.get_yticklabels(), timeline.get_yticks())}
    assert sorted(lanes) == ["group 0", "group 1", "group 2"], lanes
    bars = [(p.get_y() + p.get_height() / 2, p.get_x(), p.get_x() + p.get_width(), matplotlib.colors.to_hex(
        p.get_facecolor())) for p in timeline.patches if p.get_width() > 0]
    during = [(y, color) for y, x0, x1, color in bars if x0 < 8.5 < x1]  # the restart's start-up: job second 8.5
    assert sorted(during) == sorted([(lanes["group 0"], html.COLORS["startup"]), (lanes["group 1"], html.COLORS["training"]),
                                     (lanes["group 2"], html.COLORS["training"])]), bars
    down = [(y, x0, x1) for y, x0, x1, color in bars if color == html.COLORS["down"]]
    assert down == [(lanes["group 0"], pytest.approx(7.35), pytest.approx(8))], bars  # from its loss to its new processes


def test_the_throughput_plot_shades_the_restarts_it_names_and_names_none_where_there_are_none(monkeypatch):
    """Its title said "shaded: restarts" and nothing was shaded in a replica job (the groups' restarts have no
    job-wide down time)."""
    monkeypatch.setattr(html, "_figure", lambda fig, *args: fig)
    ax = html.throughput_figure(Run.of(replica_job())).axes[0]
    spans = [p.get_x() for p in ax.patches]
    assert "shaded: restarts" in ax.get_title() and spans == [pytest.approx(7.35 / 60)], (ax.get_title(), spans)
    plain = html.throughput_figure(Run.of([start(100, 0), *[train(s, 100 + s) for s in range(1, 10)]])).axes[0]
    assert not plain.patches and "shaded" not in plain.get_title()


def test_a_groups_start_up_is_the_sum_of_the_parts_shown():
    """The parts of a group's return (its joining and healing among them) add up to the start-up shown; 39.1 s
    of parts were shown against 37.8 s, the wait to join and heal left out of the total."""
    records = replica_job()
    back = next(i for i, r in enumerate(records) if r.get("kind") == "start" and r["restart"] == 1)
    records[back] = start(108, 30, 0, restart=1, config=30.8, process_group=0.02, preflight=0.03,
                          data_load=3.1, restore=0.04, regroup=1.3)  # (model=1 too)
    line = next(x for x in summary(Run.of(records), "r").splitlines() if "group 0: back at step 30" in x)
    total = float(re.search(r"start-up ([\d.]+) s", line).group(1))
    parts = [float(v) for v in re.findall(r"([\d.]+)(?: \||\))", line.split("(", 1)[1])]
    assert "joining and healing 1.3" in line and total == pytest.approx(sum(parts), abs=0.05 * len(parts)), line
    assert total == pytest.approx(36.29, abs=0.05), line


def test_the_heatmap_of_a_replica_job_has_a_row_per_group_with_its_compute_time(monkeypatch):
    """Each record carries every group's compute time of the step (its own ranks': the leading group's only,
    one process, always 1x its own median: one empty row); a group away is blank."""
    monkeypatch.setattr(html, "_figure", lambda fig, *args: fig)
    records = [{**r, "hosts": ["vm:0"]} if r.get("kind") == "start" else r for r in replica_job()]
    for r in records:
        if r.get("kind") == "train":
            groups = [1, 2] if 21 <= r["step"] <= 30 else [0, 1, 2]
            r |= {"compute_ms": [50.0], "group_compute_ms": [[g, 50.0 * (1.5 if g == 2 else 1)] for g in groups]}
    ax = html.heatmap_figure(Run.of(records)).axes[0]
    rows = [t.get_text() for t in ax.get_yticklabels()]
    grid = ax.get_images()[0].get_array()
    assert rows == ["group 0", "group 1", "group 2"], rows
    assert (grid[2].min(), grid[2].max()) == (pytest.approx(1.2), pytest.approx(1.5))  # group 2: the slow one
    assert int(grid[0].mask.sum()) == 10  # group 0 away for the 10 steps of its restart: blank
    assert "slowest ranks" in summary(Run.of(records), "r") and "group 2" in summary(Run.of(records), "r")
