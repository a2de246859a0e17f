"""What the loop keeps: its counters (Progress, saved in every snapshot), the data it trains on, a
step's figures, what to do after a step, and this process's role in the job."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from mingpt.data import Corpus
from mingpt.data.datasets import DocumentDataset, StreamDataset
from mingpt.data.samplers import LengthGroupedSampler, StreamSampler


@dataclass
class StepStats:
    loss_sum: torch.Tensor  # this rank's summed token loss (unreduced, on the device)
    tokens: int  # global target tokens of the step
    grad_norm: torch.Tensor  # on the device: read on the host at log steps only
    lr: float
    compute_s: float
    split: list  # every rank's micro-batches; padding/balance figures are computed at log steps only


@dataclass
class Todo:
    """What the loop does after a step, decided once, then done in this order."""
    log: bool = False
    evaluate: bool = False
    save: bool = False
    record_time: bool = False
    stop: bool = False


@dataclass(frozen=True)
class Role:
    """What this process does for the job: it logs and evaluates for it (`leads`), it writes its share
    of the snapshots (`saves`); `name`: who trains, for the start line."""
    leads: bool
    saves: bool
    name: str


@dataclass
class TrainData:
    """The splits, the training sampler and this rank's fixed validation micro-batches (padded with
    empty ones to the same count on every rank: a sharded model runs collectives in its forward)."""
    train: StreamDataset | DocumentDataset
    val: StreamDataset | DocumentDataset
    sampler: StreamSampler | LengthGroupedSampler
    val_batches: list[np.ndarray]
    corpus: Corpus  # the splits' source: closed with the Trainer (it may fetch shards ahead)


@dataclass
class Progress:
    """The counters that survive a restart."""
    step: int = 0
    tokens_seen: int = 0
    best_val_loss: float = math.inf

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "best_val_loss": self.best_val_loss}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        self.best_val_loss = float(state["best_val_loss"])
