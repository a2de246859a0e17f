"""Run under torchrun (or plain python): one training step, then rank 0 saves the gradients.

    python grad_worker.py OUT_FILE hydra.overrides...
"""

import sys

import torch

from mingpt import distributed as D
from mingpt.bench import compose_config
from mingpt.main import assemble, setup_logging


def main() -> None:
    out, overrides = sys.argv[1], sys.argv[2:]
    info = D.DistInfo.from_env()
    setup_logging(info)
    cfg = compose_config(overrides)
    D.init(info, 60)
    try:
        trainer = assemble(cfg, info).trainer
        trainer.train_step()
        if info.is_first:
            grads = {n: p.grad.clone() for n, p in trainer.raw_model.named_parameters()}
            torch.save(grads, out)
    finally:
        D.shutdown()


if __name__ == "__main__":
    main()
