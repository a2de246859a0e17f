"""How the model is spread over processes: the layouts behind one seam (layouts.py: single process,
DDP, FSDP2, HSDP, composed with tensor parallelism on one mesh), tensor parallelism (tensor.py) and
the rule for which rows of a tensor each rank holds (shards.py), which the snapshot layout follows."""
