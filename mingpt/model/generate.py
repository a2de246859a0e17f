"""Generation: a GPT's next tokens one at a time (with its KV cache), and the sampling rule."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from mingpt.model.gpt import GPT, KVCache


def new_cache(gpt: GPT, batch: int) -> KVCache:
    c = gpt.config
    p = gpt.wte.weight
    return KVCache(c.n_layer, batch, c.n_head, c.block_size, c.n_embd // c.n_head, p.device, p.dtype)


@torch.no_grad()
def stream(
    gpt: GPT, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
    top_p: float | None = None, stop_token: int | None = None, generator: torch.Generator | None = None,
    use_cache: bool = True,
) -> Iterator[torch.Tensor]:
    """Yield the next token of every row from `gpt`, (B, 1), max_new_tokens times; greedy when temperature == 0.

    The context is the last block_size tokens, as in training. With the cache each step feeds one
    token; once the context is full and slides, positions shift, so the window is fed again
    (the same arithmetic as without the cache). Stops early once every row has produced
    stop_token.
    """
    block = gpt.config.block_size
    cache, done = None, torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)
    for _ in range(max_new_tokens):
        if not use_cache:
            logits, _ = gpt(idx[:, -block:])
        elif cache is not None and cache.pos < block:
            logits, _ = gpt(idx[:, -1:], cache=cache)
        else:  # a first pass, or the window moved on: (re)fill the cache with the whole context
            cache = new_cache(gpt, idx.size(0))
            logits, _ = gpt(idx[:, -block:], cache=cache)
        nxt = sample(logits[:, -1, :], temperature, top_k, top_p, generator)  # (B, 1)
        idx = torch.cat((idx, nxt), dim=1)  # (B, T+1)
        yield nxt
        if stop_token is not None:
            done |= nxt[:, 0] == stop_token
            if bool(done.all()):
                return


def sample(logits: torch.Tensor, temperature: float, top_k: int | None = None, top_p: float | None = None,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Next tokens (B, 1) from last-position logits (B, V): greedy at temperature 0, else sampled
    from the top_k most likely and/or the smallest set whose probability reaches top_p (nucleus)."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)  # (B, 1)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]  # (B, 1)
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)  # (B, V), (B, V)
        probs = F.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens before it already reach top_p (the first one always stays)
        drop = probs.cumsum(dim=-1) - probs >= top_p  # (B, V)
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, -math.inf))
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)  # (B, 1)
