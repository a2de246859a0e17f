"""Run under torchrun (or plain python): one training step, then rank 0 saves the gradients.

    python grad_worker.py OUT_FILE hydra.overrides...
"""

import sys

import torch

from mingpt import distributed
from mingpt.compose import compose
from mingpt.main import assemble, setup_logging


def main() -> None:
    out, overrides = sys.argv[1], sys.argv[2:]
    info = distributed.DistInfo.from_env()
    setup_logging(info)
    cfg = compose(overrides)
    distributed.init(info, 60)
    run = None
    try:
        run = assemble(cfg, info)
        run.train_step()
        if run.parallel.name == "ddp":
            # a Python DDP comm hook leaves Python callbacks on gloo's threads: they abort the process
            # (SIGABRT) when they let go of them during interpreter shutdown
            hook = run.parallel.model._get_ddp_logging_data().get("comm_hook")
            assert not hook, f"a Python DDP comm hook ({hook}) is registered"
        # an FSDP gradient is a shard: every rank joins in gathering it whole
        grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone())
                 for n, p in run.parallel.gpt.named_parameters()}
        if info.is_rank0:
            torch.save(grads, out)
    finally:
        if run is not None:
            run.close()
        distributed.shutdown()
    distributed.exit_process(0, had_process_group=info.distributed)


if __name__ == "__main__":
    main()
