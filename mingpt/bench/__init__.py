"""Benchmarks, one module each: `python -m mingpt.bench NAME [options]`."""
