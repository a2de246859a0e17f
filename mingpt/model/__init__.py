"""The model and what names its parts: the GPT itself (gpt.py, pure PyTorch), its tokenizers
(tokenizer.py), the tensor-parallel plan by module name (plan.py) and the mapping to Hugging Face's
GPT-2 names (pretrained.py). A change to the model's modules is a change in this folder."""
