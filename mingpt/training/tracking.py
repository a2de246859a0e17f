"""Experiment trackers (trainer.tracker): the metrics writer's records also go to Weights & Biases or
MLflow, from the process that writes the metrics.

One tracked run per run directory: its id is kept in run_dir/tracker.json, so a resumed or restarted
run continues it. The resolved config goes in once, when the tracked run is made; then every train,
evaluation and replica-epoch record, each committed snapshot's step, and at the end the job's goodput
figures. A tracker never fails a step: its first error is one warning, and it is off for the rest of
the process (the metrics file has every record regardless).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from mingpt.runtime.storage import write_json_atomic

log = logging.getLogger(__name__)

ID_FILE = "tracker.json"  # {"wandb": run id, "mlflow": run id}: the tracked run of this run directory
KINDS = ("train", "eval", "snapshot", "epoch")  # the records tracked (a snapshot once committed)


class Tracker:
    """One backend behind the metrics writer. The tracked run is opened (or continued) at the first
    record, so that only a process that writes records opens one (replica groups: the leader)."""

    backend = ""

    def __init__(self, run_dir: str, project: str, config: dict, ends_with: Callable[[], dict] | None = None):
        """`config`: the resolved settings, nested; `ends_with`: the figures to send at the end (the goodput)."""
        self.run_dir, self.project, self.config, self.ends_with = Path(run_dir), project, config, ends_with
        self.name = self.run_dir.name
        self.live: bool | None = None  # None: not opened yet; False: off after an error
        self.last_step = 0

    def record(self, record: dict) -> None:
        """One metrics record (those of KINDS are sent)."""
        if self.live is None:
            self.live = self._guard("opening the tracked run", self._open_or_continue)
        kind = record.get("kind")
        if not self.live or kind not in KINDS or (kind == "snapshot" and record.get("status") != "committed"):
            return
        values = {f"{kind}/{k}": float(v) for k, v in record.items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "time")}
        if kind == "snapshot":
            values["snapshot/step"] = float(record["step"])
        self.last_step = max(self.last_step, record["step"])
        self._guard("logging", lambda: self._log(record["step"], values))

    def close(self, summarise: bool) -> None:
        """End this process's part of the tracked run; `summarise`: send the end figures first."""
        if not self.live:
            return
        if summarise and self.ends_with is not None:
            self._guard("logging the goodput", lambda: self._summary(self.ends_with()))
        self._guard("closing the tracked run", self._close)
        self.live = False

    def _open_or_continue(self) -> None:
        path = self.run_dir / ID_FILE
        ids = json.loads(path.read_text()) if path.is_file() else {}
        run_id = self._open(ids.get(self.backend))
        if ids.get(self.backend) != run_id:
            write_json_atomic(path, {**ids, self.backend: run_id})
        log.info("%s tracker: %s run %s (%s)", self.backend, "continuing" if self.backend in ids else "new",
                 run_id, self._where())

    def _guard(self, what: str, call: Callable[[], object]) -> bool:
        """Run one call to the backend; the first failure is one warning, and tracking stops."""
        try:
            call()
            return True
        except Exception as e:  # noqa: BLE001 - a tracker never fails a step: server down, disk full, a bug
            reason = (str(e).strip().splitlines() or [""])[0][:300]
            log.warning("%s tracker: %s failed (%s: %s); tracking is off for the rest of this process, the run goes "
                        "on (metrics.jsonl has every record)", self.backend, what, e.__class__.__name__, reason)
            self.live = False
            return False

    # --- one backend -----------------------------------------------------------------------------------
    def _open(self, run_id: str | None) -> str:
        """Open the run `run_id` again, or a new one (given the config); its id."""
        raise NotImplementedError

    def _log(self, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def _summary(self, figures: dict[str, float]) -> None:
        raise NotImplementedError

    def _close(self) -> None:
        raise NotImplementedError

    def _where(self) -> str:
        raise NotImplementedError


class WandbTracker(Tracker):
    """Weights & Biases: WANDB_MODE=offline writes the run under WANDB_DIR (else run_dir/wandb) for
    `wandb sync` later; every restart's files carry the same run id. Metrics are plotted against the
    training step (`step`), so the steps trained again after a resume are kept too."""

    backend = "wandb"

    def _open(self, run_id: str | None) -> str:
        import wandb

        self.dir = os.environ.get("WANDB_DIR", str(self.run_dir))
        Path(self.dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=self.project, name=self.name, dir=self.dir, id=run_id,
                              resume="allow" if run_id else None, config=None if run_id else self.config)
        self.run.define_metric("*", step_metric="step")
        return self.run.id

    def _log(self, step: int, values: dict[str, float]) -> None:
        self.run.log({"step": step, **values})

    def _summary(self, figures: dict[str, float]) -> None:
        self.run.summary.update({f"goodput/{k}": v for k, v in figures.items()})

    def _close(self) -> None:
        self.run.finish()

    def _where(self) -> str:
        return f"project {self.project}, files in {self.dir}/wandb"


class MlflowTracker(Tracker):
    """MLflow, at MLFLOW_TRACKING_URI: the config as the run's parameters, the records as metrics at
    their step, the goodput figures as metrics at the last step."""

    backend = "mlflow"

    def _open(self, run_id: str | None) -> str:
        # A server that is down costs seconds, not MLflow's default minutes of retries (the user's settings win)
        for key, value in (("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2"), ("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1"),
                           ("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")):
            os.environ.setdefault(key, value)
        # its HTTP client's retry lines are not ours: a call that fails after them is the one warning
        logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient()
        if run_id:
            self.client.update_run(run_id, status="RUNNING")
            self.run_id = run_id
            return run_id
        experiment = self.client.get_experiment_by_name(self.project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(self.project)
        self.run_id = self.client.create_run(experiment_id, run_name=self.name).info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in flatten(self.config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters a call
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        return self.run_id

    def _log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def _summary(self, figures: dict[str, float]) -> None:
        self._log(self.last_step, {f"goodput/{k}": v for k, v in figures.items()})

    def _close(self) -> None:
        self.client.set_terminated(self.run_id)

    def _where(self) -> str:
        return f"experiment {self.project} at {self.client.tracking_uri}"


BACKENDS = {"wandb": WandbTracker, "mlflow": MlflowTracker}


def open_tracker(kind: str, run_dir: str, project: str, config: dict,
                 ends_with: Callable[[], dict] | None = None) -> Tracker | None:
    """The tracker of trainer.tracker (None for "none"); it connects at its first record."""
    return BACKENDS[kind](run_dir, project, config, ends_with) if kind in BACKENDS else None


def flatten(config: dict, prefix: str = "") -> dict:
    """Nested settings as dotted keys: {"trainer": {"max_steps": 10}} -> {"trainer.max_steps": 10}."""
    out = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
