"""Run under torchrun (or plain python): one training step, then rank 0 saves the gradients; with
--state, no step: rank 0 saves the state the job started from (weights and optimizer state, whole).
Under a pipeline every process holds only its stage: each saves what it holds to OUT_FILE.<rank>
(after the step, its weights too, as "param.<name>").

    python grad_worker.py OUT_FILE [--state] hydra.overrides...
"""

import sys

import torch

from mingpt.config.compose import compose
from mingpt.main import assemble
from mingpt.runtime import distributed
from mingpt.runtime.console import setup_logging
from mingpt.runtime.exits import exit_process


def whole(g: torch.Tensor) -> torch.Tensor:
    """A gradient (or parameter, or optimizer state) as one process would hold it."""
    return g.full_tensor() if hasattr(g, "full_tensor") else g.clone()  # FSDP's and tensor parallel's: parts


def save_stage(run, out: str, rank: int, state: bool) -> None:
    """A pipeline process's own tensors (the other stages' are on the meta device)."""
    gpt, optimizer = run.parallel.gpt, run.optimizer
    names = {p: n for n, p in gpt.named_parameters()}
    held = [p for p in gpt.parameters() if not p.is_meta]
    if state:  # (FSDP inside the stages: its rows gathered whole, every process of the stage joining in)
        mine = {f"model.{names[p]}": whole(p.detach()) for p in held}
        mine.update({f"optim.{names[p]}.{k}": whole(v) for p, st in optimizer.state.items() for k, v in st.items()})
    else:
        run.train_step()
        mine = {names[p]: whole(p.grad) for p in held}
        mine.update({f"param.{names[p]}": whole(p.detach()) for p in held})
    torch.save(mine, f"{out}.{rank}")


def main() -> None:
    out, overrides = sys.argv[1], sys.argv[2:]
    state = overrides[:1] == ["--state"]
    overrides = overrides[state:]
    info = distributed.DistInfo.from_env()
    setup_logging(info)
    cfg = compose(overrides)
    distributed.init(info, 60)
    run = None
    try:
        run = assemble(cfg, info)
        if run.parallel.pp:
            save_stage(run, out, info.rank, state)
        elif state:
            gpt, optimizer = run.parallel.gpt, run.optimizer
            out_state = {f"model.{n}": whole(p.detach()) for n, p in gpt.named_parameters()}
            names = {p: n for n, p in gpt.named_parameters()}
            out_state.update({f"optim.{names[p]}.{k}": whole(v)
                              for p, st in optimizer.state.items() for k, v in st.items()})
            if info.is_rank0:
                torch.save(out_state, out)
        else:
            run.train_step()
            if run.parallel.name == "ddp" and not run.parallel.tp:
                # a Python DDP comm hook leaves Python callbacks on gloo's threads: they abort the process
                # (SIGABRT) when they let go of them during interpreter shutdown
                hook = run.parallel.model._get_ddp_logging_data().get("comm_hook")
                assert not hook, f"a Python DDP comm hook ({hook}) is registered"
            # an FSDP or tensor-parallel gradient is a part: every rank joins in gathering it whole
            grads = {n: whole(p.grad) for n, p in run.parallel.gpt.named_parameters()}
            if info.is_rank0:
                torch.save(grads, out)
    finally:
        if run is not None:
            run.close()
        distributed.shutdown()
    exit_process(0, had_process_group=info.distributed)


if __name__ == "__main__":
    main()
