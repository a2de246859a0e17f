"""python -m benchmarks NAME [options]

    throughput  training tokens/s, ms per step and MFU (the default when no NAME is given)
    snapshot    snapshot blocking, save and load times per shape and store; SIGKILL recovery
    batching    length-grouped against random batching of documents, 2 ranks
    generate    generation tokens/s with and without the KV cache
    plan        epoch planning time and memory of the samplers at 10^7 pieces and 10^9 tokens
    goodput     a 2-worker job SIGKILLed every T seconds: goodput and its breakdown by snapshot interval
    data        prepare throughput, start-up time and memory by dataset size, S3 against local disk
    scale       snapshot costs per rank at 2 to 32 ranks (manifest, commit, restore), fitted and projected
    s3tune      the S3 transport's part size, parts in flight, GET size and GETs in flight, on SeaweedFS
    soak        a 2-worker job with S3 snapshots SIGKILLed again and again: bitwise equal, nothing orphaned
    internode   bytes between two nodes (network namespaces) per step under DDP, FSDP and HSDP
    gpu         the GPU path on one CUDA device: flash attention, bf16/fp16, compile, MFU, a SIGKILL resumed
    survivors   3 replica groups, one SIGKILLed every T s or cut off: goodput, survivor gap, rejoin; vs one torchrun
    survivors-scale  4 to 32 replica groups: per member threads, sockets, beacon traffic, passes; forming; a SIGKILL
    membership-sim   256 and 1,024 members' beacons alone (no model): forming, re-forming after 10 lost, channels
    memory      memory per process (parameters, gradients, optimizer state, activations) by layout, tensor parallel too
    pipeline    pipeline schedules: bubble against theory, tokens/s against DDP, memory and bytes sent against the layouts
"""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = ("throughput", "snapshot", "batching", "generate", "plan", "data", "goodput", "scale", "internode", "s3tune", "soak",
              "survivors", "gpu", "memory", "pipeline", "survivors-scale", "membership-sim")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help") and len(argv) == 1:
        print(__doc__)
        return
    name, rest = (argv[0], argv[1:]) if argv and argv[0] in BENCHMARKS else ("throughput", argv)
    importlib.import_module(f"benchmarks.{name.replace('-', '_')}").main(rest)


if __name__ == "__main__":
    main()
