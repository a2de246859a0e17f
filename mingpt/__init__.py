"""mingpt: a GPT trainer that scales from a laptop to many nodes with torchrun and survives failures.

The folders are the rooms of the house, lowest first: runtime/ (the process, its group, its secret),
model/ (the GPT, its tokenizers, the names its parts go by), config/ (typed settings and Hydra),
data/ and snapshot/, parallel/ (how the model is spread), training/ (the loop), replicas/ (replica
groups, a layer on the loop), then cli/ and report/. main.py assembles a run: it is the torchrun
entry point. The benchmarks live beside the package, in benchmarks/ of a checkout.
"""
