"""How the processes of a group take part in a replica-group job: the two membership models, one class
each, chosen once (`Replicas` holds one as `membership`).

- `EveryProcess`: the group's processes do not split the model (or the group is one process). Each
  process is a member on its own: it owns whole shares, exchanges its rows with every member of the
  epoch and heals from any of them; the epoch's first member saves for the job.
- `WholeGroup`: the group's processes split the model (trainer.parallel=fsdp, trainer.tensor_parallel).
  The group owns its shares, each cut into a part per data rank of the group; a process exchanges and
  heals its shard with the process of every other group that holds the same one, and the group's
  processes vote on each exchange over their own torchrun's process group; every process of the
  epoch's first group saves (a shard each).

In both, a group leaves and joins whole (mingpt/replicas/beacon.py forms the epochs so).
"""

from __future__ import annotations

import torch

from mingpt.replicas.beacon import Epoch, MembershipChanged
from mingpt.replicas.link import ReplicaError
from mingpt.replicas.wire import Flags, ShareHeader, Vote
from mingpt.runtime import distributed

# An owner's shares by default: k = groups - 1 up to this many. With k = R - 1 a lost owner's shares go one
# to each survivor, but every member runs k backward passes and its exchange grows with R; with at most 4, a
# lost owner's shares spread over 4 survivors, whose step costs them 1.25x (5 shares for 4) while it is away.
DEFAULT_SHARES_MAX = 4


def default_shares(groups: int) -> int:
    """Shares per owner (a member, or a whole group) by default: one per other group, at most DEFAULT_SHARES_MAX."""
    return min(max(1, groups - 1), DEFAULT_SHARES_MAX)


class EveryProcess:
    """Each process a member of its own, with shares of its own."""

    sharded = False
    decides_alone = True  # a member that sees a loss drops the step at once, between two of its shares
    unit = 1  # members that own shares together
    parts = 1  # a share is trained whole, by one process
    part = 0

    def __init__(self, beacon, tp: int = 1):  # noqa: ARG002 - the models' one signature
        self.beacon = beacon

    @staticmethod
    def shares_each(asked: int, procs: int, groups: int) -> int:
        """Shares per member from replicas.shares_per_group (0: the default): a group's split among its processes."""
        shares = asked or procs * default_shares(groups)
        if shares % procs:
            raise ReplicaError(f"replicas.shares_per_group={shares} does not divide among a group's {procs} "
                               f"processes: make it a multiple of {procs} (or 0, for {procs * default_shares(groups)})")
        return shares // procs

    def saves(self, epoch: Epoch | None) -> bool:
        return epoch is not None and epoch.rank == 0

    def partners(self, epoch: Epoch) -> tuple[object, list, int]:
        """The process group of the exchange and the healing, its members, and this one's rank there."""
        return epoch.pg, epoch.members, epoch.rank

    def healed(self, numbers: list[int]) -> list[int]:
        """The members a heal brought forward, from those behind among the `partners`."""
        return numbers

    def agree(self, step: int, failed: MembershipChanged | None, every: list[ShareHeader],  # noqa: ARG002
              shares: int, device: torch.device) -> list[ShareHeader]:  # noqa: ARG002 - the models' one signature
        """The step's headers once the exchange is over: this member's exchange decides alone."""
        if failed is not None:
            raise failed
        return every


class WholeGroup:
    """A group's processes split the model: the group owns shares, and each process its shard of them."""

    sharded = True
    decides_alone = False  # the group's processes decide together, in the vote after each exchange

    def __init__(self, beacon, tp: int = 1):
        self.beacon, self.tp = beacon, tp

    @staticmethod
    def shares_each(asked: int, procs: int, groups: int) -> int:  # noqa: ARG004 - the models' one signature
        """Shares per group from replicas.shares_per_group (0: the default)."""
        return asked or default_shares(groups)

    @property
    def unit(self) -> int:
        return self.beacon.procs

    @property
    def parts(self) -> int:
        """A part per data rank of the group: its processes over the tensor-parallel degree (the processes
        of a tensor-parallel group train the same part)."""
        return self.beacon.procs // self.tp

    @property
    def part(self) -> int:
        return self.beacon.member % self.beacon.procs // self.tp

    def saves(self, epoch: Epoch | None) -> bool:
        procs = self.beacon.procs
        return epoch is not None and epoch.members[0].number // procs == self.beacon.member // procs

    def partners(self, epoch: Epoch) -> tuple[object, list, int]:
        """The members holding this process's shard (the same process of every group), and its rank there."""
        holders = epoch.holders(self.beacon.member, self.beacon.procs)
        return epoch.shard_pg, holders, [m.number for m in holders].index(self.beacon.member)

    def healed(self, numbers: list[int]) -> list[int]:
        """A group heals whole, a shard each: every process of each group behind."""
        return [s for n in numbers for s in self.beacon.siblings(n)]

    def agree(self, step: int, failed: MembershipChanged | None, every: list[ShareHeader], shares: int,
              device: torch.device) -> list[ShareHeader]:
        """After the exchange of this process's shard, a vote of the group's processes over their own
        process group: the group applies the step only if every one of them completed its exchange (so
        its shards stay one state), and agrees on the flags, each share's samples (summed over the
        parts) and whether a stop signal reached a process of the group that trained it. The headers
        returned are the group's: flags and samples of every part; the loss and the trainer are this
        part's and group's (the trainer's log sums the parts' losses)."""
        mine = Vote(float(failed is not None), Flags.of(every), [[h.samples, h.ids, h.preempted] for h in every])
        # over the group's own process group (its torchrun's), on the model's device (NCCL's on GPUs)
        agreed = Vote.unpack(distributed.all_reduce_sum(mine.pack(shares).to(device)).cpu(), shares)
        if agreed.failed > 0:
            raise failed or MembershipChanged(f"a process of this group did not complete the exchange of step {step}")
        flags = Flags(*(float(n > 0) for n in agreed.flags))
        # (each part's samples counted once: the processes of a tensor-parallel group train the same part)
        return [h._replace(**flags._asdict(), samples=samples / self.tp, ids=ids / self.tp, preempted=float(stops > 0))
                for h, (samples, ids, stops) in zip(every, agreed.counts)]


def model_of(sharded: bool, procs: int) -> type[EveryProcess] | type[WholeGroup]:
    """The membership model: whole groups where a group's several processes split the model."""
    return WholeGroup if sharded and procs > 1 else EveryProcess
