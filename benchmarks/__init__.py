"""Benchmarks, one module each: `python -m benchmarks NAME [options]`."""
