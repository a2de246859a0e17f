"""What replica groups send as tensors: gradients flattened and set back, and the healing state's
digest (keyed by the job secret: gloo authenticates nothing). The exchange's rows are wire.py's."""

from __future__ import annotations

import hashlib
import hmac
import json

import torch

from mingpt.parallel.shards import own_part

MAX_STATE_JSON = 64 * 2**20  # the sampler's and counters' state: kilobytes; a size beyond this is no state of ours


def state_digest(key: bytes, slots: list, meta: dict, tensors: list | None = None) -> str:
    """HMAC-SHA256 (keyed by the job secret) of the JSON state and every tensor's bytes (the slots', or
    `tensors` in their place)."""
    h = hmac.new(key, json.dumps({k: v for k, v in meta.items() if k != "digest"}, sort_keys=True).encode(),
                 hashlib.sha256)
    for slot, t in zip(slots, tensors or [s.local for s in slots]):
        t = t.detach().cpu().contiguous()
        h.update(slot.name.encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def heal_tag(key: bytes, digest: str, epoch: int, source: int, receiver: int) -> str:
    """A heal's digest bound to its epoch, its sender and one receiver (member numbers): a heal recorded
    in one epoch, or sent to another member, does not verify again. The state is hashed once
    (state_digest); only this tag is made per receiver."""
    return hmac.new(key, f"heal:{epoch}:{source}:{receiver}:{digest}".encode(), hashlib.sha256).hexdigest()


HEAL_BUCKET_BYTES = 64 * 2**20  # a heal sends the state in buffers of about this size: one collective each
ALIGN = 16  # each tensor's bytes start at a multiple of this in its buffer (any dtype can view them there)


def buckets(tensors: list[torch.Tensor], limit: int = HEAL_BUCKET_BYTES) -> list[tuple[int, list[tuple[int, int]]]]:
    """The tensors' bytes packed in order into buffers of at most `limit` bytes (a bigger tensor alone in
    one of its own): [(the buffer's size, [(tensor index, its offset)])]."""
    out: list[tuple[int, list[tuple[int, int]]]] = []
    size, members = 0, []
    for i, t in enumerate(tensors):
        n = t.numel() * t.element_size()
        if members and size + n > limit:
            out.append((size, members))
            size, members = 0, []
        members.append((i, size))
        size = -(-(size + n) // ALIGN) * ALIGN
    if members:
        out.append((size, members))
    return out


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, as a flat uint8 view."""
    return t.reshape(-1).view(torch.uint8)


def flat_grads(model: torch.nn.Module, into: torch.Tensor | None = None) -> torch.Tensor:
    """Every parameter's gradient (under FSDP: this process's shard of it) in one host tensor (parameter
    order; none: zeros); given `into`, added to it in place. A parameter at a time: one host row, not a
    copy of every gradient and then their concatenation."""
    out = torch.empty(sum(own_part(p).numel() for p in model.parameters())) if into is None else into
    offset = 0
    for p in model.parameters():
        g = own_part(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1)
        part = out[offset:offset + g.numel()]
        if into is None:
            part.copy_(g)
        else:
            part.add_(g.float().cpu())
        offset += g.numel()
    return out


class Rows:
    """A member's gradients of a step as the exchange takes them: its own shares (`own`, a range) folded
    in share order into one host accumulator as they are trained (its owner's subtree of the step's
    sum: `acc = row(s0).clone(); acc += row(s1); ...`, the same fold whoever makes it), and a row apiece
    for the shares of lost owners dealt to it. Each share is still its own backward into zeroed
    gradients: accumulating several shares' micro-batches in p.grad would add them in another order."""

    def __init__(self, own: range):
        self.own = own
        self.acc: torch.Tensor | None = None
        self.folded = 0  # own shares in `acc`: always a prefix of `own`
        self.orphans: dict[int, torch.Tensor] = {}
        self.meta: dict[int, tuple] = {}  # every share done -> (its summed token loss, its micro-batches)

    def __contains__(self, share: int) -> bool:
        return share in self.meta

    def __len__(self) -> int:
        return len(self.meta)

    def add(self, share: int, model: torch.nn.Module, loss: torch.Tensor, micro_batches: list) -> None:
        """`share`'s gradient, as the model holds it after the share's backward."""
        if share in self.own:
            if share != self.own[self.folded]:
                raise ValueError(f"share {share} out of order: the next of {self.own} to fold is {self.own[self.folded]}")
            self.acc = flat_grads(model, self.acc)
            self.folded += 1
        else:
            self.orphans[share] = flat_grads(model)
        self.meta[share] = (loss, micro_batches)

    def keep(self, mine: list[int]) -> Rows:
        """What still holds for the redo of the step in the next epoch (the same weights and samples): the
        accumulator's own shares, and the orphan rows of the shares still dealt to this member (`mine`)."""
        self.orphans = {s: row for s, row in self.orphans.items() if s in mine}
        self.meta = {s: m for s, m in self.meta.items() if s in self.orphans or s in self.own[:self.folded]}
        return self

    def rows(self) -> dict[tuple[int, ...], torch.Tensor]:
        """The exchange's gradient rows: the shares each one carries -> the row."""
        out = {tuple(self.own[:self.folded]): self.acc} if self.folded else {}
        return out | {(s,): row for s, row in sorted(self.orphans.items())}


@torch.no_grad()
def set_grads(model: torch.nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    for p in model.parameters():
        mine = own_part(p)
        n = mine.numel()
        g = flat[offset:offset + n].view_as(mine).to(mine.device, mine.dtype).clone()
        if mine is not p:  # an FSDP shard: the gradient is a DTensor laid out as the parameter
            from torch.distributed.tensor import DTensor
            g = DTensor.from_local(g, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
        p.grad = g
        offset += n


def unpack_state(blob: torch.Tensor) -> tuple[dict | None, dict | None]:
    """A heal's JSON state and the tags its sender put in it (heal_tag, by receiver); (None, None) when it is not JSON."""
    try:
        meta = json.loads(bytes(blob.numpy()))
    except ValueError:
        return None, None
    return meta, meta.pop("digest", None) if isinstance(meta, dict) else None
