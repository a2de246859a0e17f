"""Optimizer parameter groups and the learning-rate schedule, as pure functions."""

from __future__ import annotations

import math

import torch
import torch.nn as nn


def lr_at(step: int, lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> float:
    """Linear warmup to lr over warmup_steps, then cosine decay to min_lr at max_steps.

    `step` counts optimizer steps already taken (0 for the first update).
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay 2-D weights (matmuls, embeddings); leave biases and LayerNorm gains alone."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}  # tied weights appear once
    decay = [p for p in params.values() if p.dim() >= 2]
    no_decay = [p for p in params.values() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, lr: float, betas: tuple[float, float], weight_decay: float,
                    ) -> torch.optim.AdamW:
    # The fused kernel updates all parameters in one pass; on CPU it is also ~5x faster than
    # foreach (0.40 vs 1.95-2.04 ms per step for the 0.82M-parameter reference model, 2026-11-26).
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, fused=True)


def init_state(optimizer: torch.optim.AdamW) -> torch.optim.AdamW:
    """Create AdamW's per-parameter state now (zero moments, step 0: what its first step creates),
    so that a snapshot can be loaded into it and every save has the same tensors; returns it."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not optimizer.state[p]:
                step_dtype = torch.float32 if group["fused"] or group["capturable"] else torch.get_default_dtype()
                device = p.device if group["fused"] or group["capturable"] else "cpu"
                optimizer.state[p] = {"step": torch.zeros((), dtype=step_dtype, device=device),
                                      "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                      "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
    return optimizer
