"""Replica groups: data parallelism across groups that survive each other's loss.

A job of R groups, each its own torchrun (or one process), trains one model. The global batch is
always cut into R x k *shares* (the split a world of R x k ranks would make; k = min(R - 1, 4) by
default); each group trains its own k, and while a group is lost its shares are dealt out among the
survivors (one each at most, by default). A step's gradient is the sum of every share's gradient **in share
order**, whoever computed them, so a run with faults ends with the same weights, bit for bit, as one
without.

Who is alive is told by heartbeats of our own (`Beacon`): every group's process listens on its
`replicas.peers` address and keeps channels to a few others (the coordinator and its successor, its
own group's processes), with a heartbeat each way every `heartbeat_s`; the coordinator hears every
member and tells each its verdict on their epoch. A peer is lost when its connection breaks (a
killed process) or after `lost_after_s` of silence (a lost node, a cut network). The members of an
*epoch* train together over links made for that epoch (a ring of the members: `Ring`): when one is lost, the others drop
the step in flight (nothing is applied from a gradient exchange that did not complete), form the
next epoch without it and train the step again. A group that (re)starts asks to join; the members
let it in at the next step boundary, and it heals from a live member: the whole training state sent
round the epoch's ring as tensors plus JSON (never a pickle), checked by a digest before its
first step.

A group of several processes is one unit: it leaves whole when one of its processes is lost, and
joins only whole. With `trainer.parallel=fsdp` its processes shard the model (a fault-tolerant
HSDP), with `trainer.tensor_parallel` they split every block: the shares are then the group's, each
cut into a part per data rank of the group, and the exchange and the healing run per shard, among
the processes of every group that hold the same part of the model.

The epoch is formed by its *coordinator*, the lowest-numbered group alive: there is no fixed
coordinator to lose. A side of a cut network that holds fewer than `min_groups` groups (by default a
majority) does not train: it waits to rejoin, so two halves of a job never train apart.
Every connection is mutual TLS 1.3 with a certificate derived from the job secret (both ends prove
it, and each names itself inside the channel, so a relay cannot pass one member for another); every
message is a typed record checked at the edge (mingpt/replicas/wire.py), nothing received is
unpickled, and the coordinator takes who trained in the last epoch from its own record, not from a
member's word. The exchange's and the healing's transfers run over gloo, whose connections are not
authenticated (see docs/replicas.md, Security).
"""

from mingpt.replicas.beacon import Beacon, Epoch, Member, MembershipChanged
from mingpt.replicas.group import ReplicaExit, Replicas, default_min_groups, member_view
from mingpt.replicas.link import ReplicaError
from mingpt.replicas.tensors import Rows, set_grads

__all__ = ["Beacon", "Epoch", "Member", "MembershipChanged", "ReplicaError", "ReplicaExit", "Replicas", "Rows",
           "default_min_groups", "member_view", "set_grads"]
