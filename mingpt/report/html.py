"""The run's report as one self-contained HTML page: the summary, and plots embedded as PNG data
(matplotlib, the optional `report` extra; no network, no scripts from elsewhere)."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from mingpt.report.goodput import CATEGORIES, LABELS
from mingpt.report.summary import Run, summary

COLORS = {"training": "#2a9d3f", "lost": "#e76f51", "down": "#b5179e", "startup": "#f4a261", "data_wait": "#8ecae6",
          "eval": "#457b9d", "snapshot": "#6c757d", "log": "#ced4da", "regroup": "#ffb703", "other": "#e9ecef"}

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }}
pre {{ background: #f6f6f6; padding: 1em; overflow-x: auto; font-size: 13px; }}
figure {{ margin: 1.5em 0; }} img {{ max-width: 100%; }} figcaption {{ color: #555; font-size: 14px; }}
</style></head>
<body>
<h1>{title}</h1>
<pre>{summary}</pre>
{figures}
<script>
window.addEventListener("error", e => {{
  document.body.dataset.errors = (document.body.dataset.errors || "") + e.message + ";";
}});
window.addEventListener("load", () => {{
  const imgs = [...document.images];
  document.body.dataset.plots = imgs.filter(i => i.complete && i.naturalWidth > 0).length + "/" + imgs.length;
}});
</script>
</body></html>
"""


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _figure(fig, name: str, caption: str, points: int) -> str:
    return (f'<figure id="{name}"><img alt="{html.escape(caption)}" data-points="{points}" '
            f'src="data:image/png;base64,{_png(fig)}"><figcaption>{html.escape(caption)}</figcaption></figure>')


def _mark_restarts(ax, run: Run, x_of) -> None:
    """A dashed line at every restart (the summary's), labelled with its world size (a replica group's:
    the group, whose world is its own); a dotted grey one where another job continued the run (a
    resume after Ctrl-C or a stop: no restart)."""
    acc = run.account
    for i, a in enumerate(acc.attempts):
        x = x_of(a) if i else None
        if x is None:
            continue
        restart = i in acc.restarts
        ax.axvline(x, color="#b5179e" if restart else "#6c757d", ls="--" if restart else ":", lw=0.8, alpha=0.7)
        label = f" group {a.start['group']}" if "group" in a.start else f" ws {a.start['world_size']}"
        ax.text(x, 1.0, label if restart else " new job", fontsize=7, va="top",
                transform=ax.get_xaxis_transform(), color="#b5179e" if restart else "#6c757d")


def loss_figure(run: Run) -> str:
    fig, (by_step, by_tokens) = plt.subplots(1, 2, figsize=(12, 4))
    steps = list(run.train)
    loss = [run.train[s]["loss"] for s in steps]
    tokens = [run.train[s].get("tokens_seen", 0) for s in steps]
    by_step.plot(steps, loss, lw=1, label="train")
    by_tokens.plot(tokens, loss, lw=1, label="train")
    if run.evals:
        es = list(run.evals)
        ev = [run.evals[s]["val_loss"] for s in es]
        by_step.plot(es, ev, "o-", ms=3, label="validation")
        tok_at = dict(zip(steps, tokens))
        pairs = [(tok_at[s], v) for s, v in zip(es, ev) if s in tok_at]
        if pairs:
            by_tokens.plot(*zip(*pairs), "o-", ms=3, label="validation")
    _mark_restarts(by_step, run, lambda a: a.first_step)
    tok_at = dict(zip(steps, tokens))
    _mark_restarts(by_tokens, run, lambda a: tok_at.get(a.first_step))
    by_step.set(xlabel="step", ylabel="loss", title="loss by step (dashed: restarts, with the new world size)")
    by_tokens.set(xlabel="tokens", ylabel="loss", title="loss by tokens")
    for ax in (by_step, by_tokens):
        ax.grid(alpha=0.3)
        ax.legend()
    return _figure(fig, "loss", "Training and validation loss against step and tokens; restarts marked.", len(steps))


def _rate_limit(values: list[float]) -> float:
    """The top of a rate's axis: its largest value, unless that is far above the rest (a point measured
    over a wrong interval): then 3x the median, the point drawn at the edge."""
    median = float(np.median(values)) if values else 0.0
    top = max(values, default=0.0)
    return 1.05 * (top if top <= 3 * median else 3 * median) or 1.0


def throughput_figure(run: Run) -> str:
    acc = run.account
    recs = [r for r in run.records if r.get("kind") == "train"]
    minutes = [acc.clock(r["time"]) / 60 for r in recs]
    rates = [r["tokens_per_s"] for r in recs]
    fig, ax = plt.subplots(figsize=(12, 3.5))
    top = _rate_limit(rates)
    ax.plot(minutes, [min(v, top) for v in rates], ".", ms=3, color="#1d3557")
    off = [(m, top) for m, v in zip(minutes, rates) if v > top]
    if off:
        ax.plot(*zip(*off), "^", ms=5, color="red", label=f"{len(off)} off the scale")
    ax.set_ylim(0, top)
    shaded = _restart_spans(acc)
    ax.set(xlabel="job time (min; the time between jobs left out)", ylabel="tokens/s",
           title="throughput and MFU" + ("" if not shaded else " (shaded: restarts of a group, from its loss to its"
                                         " return; the others trained on)" if acc.replicas else " (shaded: restarts,"
                                         " from the last record before a fault to the first step after it)"))
    # MFU is tokens/s times a constant of the model and hardware: a second scale, not a second series
    per_token = [100 * r["mfu"] / r["tokens_per_s"] for r in recs if r.get("mfu") and r.get("tokens_per_s")]
    if per_token:
        mfu = ax.twinx()
        low, high = ax.get_ylim()
        mfu.set_ylim(low * float(np.median(per_token)), high * float(np.median(per_token)))
        mfu.set_ylabel("MFU (%)")
    for n, (start, end) in enumerate(shaded):
        ax.axvspan(start / 60, end / 60, color="#b5179e", alpha=0.25, label=None if n else "restart")
    if off or shaded:
        ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    return _figure(fig, "throughput", "Tokens/s (dots, left) and MFU (right) of every logged step over the job's "
                   "time.", len(recs))


def _restart_spans(acc) -> list[tuple[float, float]]:
    """The restarts the summary counts, as (job seconds from, to): a plain job's from its last
    record before the fault to the first step after it; a replica group's from the epoch formed without
    it to its return (its start record), while the other groups trained on."""
    spans = []
    for i in acc.restarts:
        a = acc.attempts[i]
        start = acc.lost_at.get(i, a.t0) if acc.replicas else a.t0 - acc.gaps[i]
        spans.append((acc.clock(start), acc.clock(a.t0 + a.startup_s)))
    return spans


def heatmap_figure(run: Run) -> str:
    # a replica job's rows are its groups (each record carries every group's compute), a plain job's its ranks
    recs = [(r, pairs) for r, pairs in run.logged if pairs]
    rows = sorted({name for _, pairs in recs for name, _ in pairs})
    grid = np.full((len(rows), len(recs)), np.nan)  # blank: not in that step (a replica group away)
    index = {name: i for i, name in enumerate(rows)}
    for j, (_, pairs) in enumerate(recs):
        median = max(float(np.median([c for _, c in pairs])), 1e-9)
        for name, c in pairs:
            grid[index[name], j] = c / median
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.35 * max(1, len(rows))))
    # the colour scale of the usual spread (99% of the cells): one step 8x its median washed out every other
    spread = max(0.1, float(np.nanpercentile(np.abs(grid - 1), 99)) if recs else 0.1)
    im = ax.imshow(grid, aspect="auto", cmap="coolwarm", vmin=1 - spread, vmax=1 + spread, interpolation="nearest")
    ax.set_yticks(range(len(rows)), rows)
    ticks = np.linspace(0, max(0, len(recs) - 1), min(10, max(1, len(recs)))).astype(int)
    ax.set_xticks(ticks, [recs[t][0]["step"] for t in ticks] if recs else [])
    kept = {id(r) for r, _ in recs}
    acc = run.account
    again = set() if acc.replicas else {id(acc.attempts[i].start) for i in acc.restarts}
    starts, column = [], 0
    for r in run.records:  # the column of the first record after each restart, where steps are trained again
        if id(r) in again and column:
            starts.append(column)
        column += id(r) in kept
    for j in sorted(set(starts)):  # a restart: the steps after it were logged again
        ax.axvline(j - 0.5, color="black", lw=1.5)
    who = "each replica group (blank: away)" if acc.replicas else "each rank"
    ax.set(xlabel="logged step" + ("" if acc.replicas else " (black lines: restarts, after which steps are trained "
                                   "again)"), title=f"compute time per logged step, {who} against the step's median "
                                                    "(red: slower)")
    fig.colorbar(im, ax=ax, fraction=0.02, label="x median")
    return _figure(fig, "ranks", "Each rank's step compute time over the step's median, per logged step: a slow "
                   "host is a red row.", int(np.isfinite(grid).sum()))


def snapshot_figure(run: Run) -> str:
    clock = run.account.clock
    fig, ax = plt.subplots(figsize=(12, 3))
    done = [s for s in run.snapshots if s["status"] == "committed"]
    failed = [s for s in run.snapshots if s["status"] == "failed"]
    retries = [s for s in run.snapshots if s["status"] == "retry"]
    # a bar per save at its commit, as tall as it took: its width in points, not in minutes (a save of a
    # second is a thousandth of an hour's axis, too thin to see)
    ax.vlines([clock(s["time"]) / 60 for s in done], 0, [s["total_s"] for s in done], color="#2a9d3f", lw=4,
              label="save, copy to commit")
    ax.plot([clock(s["time"]) / 60 for s in done], [s["blocking_s"] for s in done], "v", ms=4, color="#1d3557",
            label="blocking (copy)")
    if failed:
        ax.plot([clock(s["time"]) / 60 for s in failed], [s["total_s"] for s in failed], "x", ms=8, color="red",
                label="failed")
    if retries:
        ax.plot([clock(s["time"]) / 60 for s in retries], [0] * len(retries), "^", ms=6, color="orange",
                label="retried")
    end = max(r["time"] for r in run.records if "time" in r)
    ax.set_xlim(0, max(clock(end) / 60, 1e-3))
    ax.set(xlabel="job time (min)", ylabel="seconds", title="snapshots: duration of every save")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    return _figure(fig, "snapshots", "Every save at its commit (height: its duration from the copy), the "
                   "blocking part, failures and retries.", len(run.snapshots))


def goodput_figure(run: Run) -> str:
    acc = run.account
    lanes = len({a.start.get("group") for a in acc.attempts}) if acc.replicas else 1
    fig, (bar, timeline) = plt.subplots(2, 1, figsize=(12, 3.1 + 0.5 * lanes),
                                        gridspec_kw={"height_ratios": [1, 0.9 + 0.5 * lanes]})
    left = 0.0
    for c in CATEGORIES:
        share = acc.seconds[c] / acc.wall if acc.wall else 0.0
        bar.barh(0, share, left=left, color=COLORS[c], label=f"{LABELS[c]} {100 * share:.1f}%")
        if share > 0.04:
            bar.text(left + share / 2, 0, f"{100 * share:.0f}%", ha="center", va="center", fontsize=8)
        left += share
    bar.set(xlim=(0, 1), yticks=[], xticks=[], title=f"goodput {100 * acc.goodput:.1f}% of {acc.wall:.0f} s")
    bar.legend(ncol=4, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15), frameon=False)
    if acc.replicas:
        _group_lanes(timeline, acc)
    for i, a in enumerate([] if acc.replicas else acc.attempts):  # each start: down, start-up, then training
        start_s, left = a.startup_s, acc.clock(a.t0)
        if acc.gaps[i]:
            timeline.barh(0, acc.gaps[i], left=left - acc.gaps[i], color=COLORS["down"])
        timeline.barh(0, start_s, left=left, color=COLORS["startup"])
        timeline.barh(0, a.end - a.t0 - start_s, left=left + start_s, color=COLORS["training"])
    timeline.set(xlabel="job time (s; the time between jobs left out)",
                 title="starts: restart (purple), start-up (orange), then training with its evaluations and saves (green)")
    if not acc.replicas:
        timeline.set(yticks=[])
    fig.subplots_adjust(hspace=1.4)
    return _figure(fig, "goodput", "Where the wall time went, and the life of the job start by start.",
                   len(acc.attempts))


def _group_lanes(ax, acc) -> None:
    """A replica job's starts, a lane per group (the others trained through a group's restart): each
    start's start-up to its return (its start record), training until the group was lost (the epoch
    formed without it), then its restart (purple) until its processes started again."""
    groups = sorted({a.start.get("group") for a in acc.attempts}, key=str)
    lane = {g: len(groups) - 1 - n for n, g in enumerate(groups)}  # the first group on top
    end = acc.clock(acc.t0 + acc.wall)
    for i, a in enumerate(acc.attempts):
        y, left, back = lane[a.start.get("group")], acc.clock(a.t0), acc.clock(a.t0 + a.startup_s)
        ax.barh(y, back - left, left=left, color=COLORS["startup"])
        later = [j for j in acc.restarts if j > i and acc.attempts[j].start.get("group") == a.start.get("group")]
        lost = acc.clock(acc.lost_at[later[0]]) if later else end
        ax.barh(y, max(0.0, lost - back), left=back, color=COLORS["training"])
        if later:
            ax.barh(y, max(0.0, acc.clock(acc.attempts[later[0]].t0) - lost), left=lost, color=COLORS["down"])
    ax.set_yticks([lane[g] for g in groups], [f"group {g}" for g in groups])


def write_html(run: Run, path: Path, name: str) -> None:
    figures = []
    if run.train:
        figures += [loss_figure(run), throughput_figure(run), heatmap_figure(run)]
    if run.snapshots:
        figures.append(snapshot_figure(run))
    if run.account.attempts:
        figures.append(goodput_figure(run))
    page = PAGE.format(title=html.escape(f"mingpt run {name}"), summary=html.escape(summary(run, name)),
                       figures="\n".join(figures))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(page)
    tmp.replace(path)
