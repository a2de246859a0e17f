"""A run's summary and its page (mingpt/report/summary.py, html.py)."""

from conftest import ledger


def test_the_summary_counts_steps_past_the_last_logged_one_and_every_save_is_a_visible_bar(monkeypatch):
    """A run stopped (or saved) after its last logged step reports that step; a save of a fraction of a
    second is a bar a few points wide at its commit, on an axis of minutes."""
    from matplotlib.collections import LineCollection

    from mingpt.report import html
    from mingpt.report.summary import Run, summary

    saves = [{"kind": "snapshot", "step": s, "status": "committed", "total_s": 0.2, "blocking_s": 0.01,
              "time": 1000 + 6 * s} for s in (10, 20, 47)]
    run = Run.of([ledger(1000, 0, "start"), {"kind": "train", "step": 40, "loss": 2.0, "tokens_seen": 400},
                  ledger(1000, 47, step_compute=280), *saves])
    assert "  steps 47   last logged step 40: tokens 400   last train loss 2.0000" in summary(run, "r")
    monkeypatch.setattr(html, "_figure", lambda fig, *args: fig)
    ax = html.snapshot_figure(run).axes[0]
    bars = [c for c in ax.collections if isinstance(c, LineCollection)]
    assert len(bars) == 1 and min(bars[0].get_linewidths()) >= 3  # points: visible on any axis
    assert [(a[0], b[0], b[1]) for a, b in bars[0].get_segments()] == [(s["step"] / 10, s["step"] / 10, 0.2)
                                                                      for s in saves]


def test_a_job_without_replica_groups_has_no_replica_lines():
    """The summary of a plain job listed "replica groups: ..." and "other (replica groups ...)" at 0.0 s."""
    from mingpt.report.summary import Run, summary

    records = [ledger(1000, 0, "start"), {"kind": "train", "step": 5, "loss": 2.0, "tokens_seen": 50, "step_ms": 2.0,
                                          "time": 1001.0},
               ledger(1000, 5, step_compute=10)]
    plain = summary(Run.of(records), "r")
    assert "training, kept" in plain and "replica groups" not in plain
    with_epochs = summary(Run.of([*records, {"kind": "epoch", "step": 0, "epoch": 0, "groups": [0, 1], "why": "start",
                                             "regroup_s": 0.1, "healed": [], "healed_from": None, "time": 1000.5}]),
                          "r")
    assert "replica groups: a new epoch formed" in with_epochs
