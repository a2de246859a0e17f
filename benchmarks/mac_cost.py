"""What a MAC over the replica exchange's gradient rows would cost per step at gpt2 size (docs/replicas.md:
Security): one pass of HMAC-SHA256 and of keyed blake2b over 124M fp32 values, on one core.

    python benchmarks/mac_cost.py
"""

import hashlib
import hmac
import time

import torch

PARAMS = 124_439_808  # gpt2 (124M)


def main() -> None:
    data, key = torch.randn(PARAMS).numpy().tobytes(), b"k" * 32
    for name, mac in (("hmac-sha256", lambda: hmac.new(key, data, hashlib.sha256).digest()),
                      ("blake2b keyed", lambda: hashlib.blake2b(data, key=key).digest())):
        mac()
        start = time.perf_counter()
        mac()
        took = time.perf_counter() - start
        print(f"{name}: {took:.3f} s per {len(data) / 1e6:.0f} MB ({len(data) / took / 1e9:.2f} GB/s)")


if __name__ == "__main__":
    main()
