"""The model's modules by name, as the parallel layouts split them: the one place besides gpt.py that
names them (pretrained.py maps the same names to Hugging Face's). A new or renamed module in gpt.py
is added here, and parallel/tensor.py applies it.

Tensor parallelism is Megatron's split with the stream between sub-layers split by tokens:
"colwise" splits a Linear's output features, "rowwise" its input features (its input arrives split;
its output is summed over the group); "sequence" runs a norm on each process's own tokens; "gather"
gives a sub-layer the whole sequence (its input split by tokens)."""

# the layers of one block (gpt.blocks[i]), by their names inside it
BLOCK = {"attn.c_q": "colwise", "attn.c_k": "colwise", "attn.c_v": "colwise", "attn.c_proj": "rowwise",
         "mlp.c_fc": "colwise", "mlp.c_proj": "rowwise",
         "ln_1": "sequence", "attn": "gather", "ln_2": "sequence", "mlp": "gather"}
# outside the blocks: the tied token embedding and LM head split by vocabulary rows
TOP = {"wte": "vocab rows", "wpe": "positions", "ln_f": "sequence", "lm_head": "vocab columns"}
# the blocks' container in gpt.py
BLOCKS = "blocks"
