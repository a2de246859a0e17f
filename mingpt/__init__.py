"""mingpt: a GPT trainer that scales from a laptop to many nodes with torchrun and survives failures.

The library: model.py, tokenizer.py, data/, training/, snapshot/, distributed.py, with config.py
(typed settings) and compose.py (Hydra). main.py assembles a run: it is the torchrun entry point.
Command-line tools are in cli/; the benchmarks live beside the package, in benchmarks/ of a checkout.
"""
