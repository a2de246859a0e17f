"""A GPT-2 style decoder-only transformer.

This file is pure PyTorch: no distributed code, no environment, no I/O, no printing.
Its configuration dataclass sits beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from mingpt.parallel.shards import assign

# name -> (n_layer, n_head, n_embd)
PRESETS: dict[str, tuple[int, int, int]] = {
    "gpt-nano": (3, 3, 48),
    "gpt-micro": (4, 4, 128),
    "gpt-mini": (6, 6, 192),
    "gopher-44m": (8, 16, 512),
    "gpt2": (12, 12, 768),
    "gpt2-medium": (24, 16, 1024),
    "gpt2-large": (36, 20, 1280),
    "gpt2-xl": (48, 25, 1600),
}

# Fields that fix the shape of the parameters: a snapshot must agree on all of them.
SHAPE_FIELDS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "padded_vocab_size", "bias")


def pad_vocab(vocab_size: int, multiple: int = 64) -> int:
    """Round the vocabulary up so the embedding and LM-head matmuls hit fast kernel shapes."""
    return ((vocab_size + multiple - 1) // multiple) * multiple


@dataclass(frozen=True)
class GPTConfig:
    """Shape and regularisation of the GPT."""

    preset: str | None = "gpt-mini"
    """A named shape (see PRESETS); n_layer/n_head/n_embd below override it when set."""
    n_layer: int | None = None
    """Number of transformer blocks; None takes the preset's."""
    n_head: int | None = None
    """Attention heads per block; must divide n_embd. None takes the preset's."""
    n_embd: int | None = None
    """Width of the residual stream; None takes the preset's."""
    block_size: int = 0
    """Longest context the model can see (size of the position embedding). Set from the run's
    data.block_size when the run is assembled, so training and sampling use the same context."""
    vocab_size: int = 0
    """Real vocabulary size; set from the tokenizer when the run is assembled."""
    dropout: float = 0.0
    """Dropout on attention weights, residual branches and embeddings."""
    bias: bool = True
    """Biases in Linear and LayerNorm layers, as in GPT-2."""
    init_from: str | None = None
    """Start from GPT-2's weights: gpt2, gpt2-medium, gpt2-large, gpt2-xl (Hugging Face hub, through
    its cache; HF_HUB_OFFLINE is respected) or a local Hugging Face GPT-2 directory (config.json and
    model.safetensors). The shape comes from the weights; a snapshot in the store still wins."""

    def __post_init__(self) -> None:
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(
                f"model.preset={self.preset!r} is not a known preset; choose one of "
                f"{', '.join(PRESETS)} or set preset=null with n_layer, n_head and n_embd"
            )
        if self.preset is None and None in (self.n_layer, self.n_head, self.n_embd):
            raise ValueError("model.preset is null: set model.n_layer, model.n_head and model.n_embd")
        layer, head, embd = self.shape
        if min(layer, head, embd) <= 0:
            raise ValueError(f"model shape must be positive, got n_layer={layer} n_head={head} n_embd={embd}")
        if embd % head != 0:
            raise ValueError(
                f"model.n_embd={embd} is not divisible by model.n_head={head}; "
                "choose n_embd as a multiple of n_head"
            )
        if self.block_size < 0:
            raise ValueError(f"model.block_size must be >= 0, got {self.block_size}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if self.vocab_size < 0:
            raise ValueError(f"model.vocab_size must be >= 0, got {self.vocab_size}")

    @property
    def shape(self) -> tuple[int, int, int]:
        """(n_layer, n_head, n_embd) after applying the preset and the overrides."""
        base = PRESETS[self.preset] if self.preset is not None else (0, 0, 0)
        return (
            self.n_layer if self.n_layer is not None else base[0],
            self.n_head if self.n_head is not None else base[1],
            self.n_embd if self.n_embd is not None else base[2],
        )

    @property
    def padded_vocab_size(self) -> int:
        return pad_vocab(self.vocab_size)

    def resolved(self) -> GPTConfig:
        """The same config with the preset folded into explicit fields."""
        layer, head, embd = self.shape
        return replace(self, n_layer=layer, n_head=head, n_embd=embd)

    def shape_dict(self) -> dict:
        r = self.resolved()
        return {k: getattr(r, k) for k in SHAPE_FIELDS}


# model=custom: a shape of your own, starting from gpt-micro's (model.n_layer=... and so on override it)
CUSTOM = GPTConfig(preset=None, n_layer=4, n_head=4, n_embd=128)


class KVCache:
    """Keys and values of the positions seen so far, per layer, for generating one token at a time.

    Preallocated for the model's whole context: appending writes in place, nothing is copied.
    """

    def __init__(self, n_layer: int, batch: int, n_head: int, block_size: int, head_size: int,
                 device: torch.device, dtype: torch.dtype):
        shape = (n_layer, batch, n_head, block_size, head_size)  # (L, B, nh, block, hs)
        self.k = torch.empty(shape, device=device, dtype=dtype)
        self.v = torch.empty(shape, device=device, dtype=dtype)
        self.pos = 0  # positions filled (the same in every layer once a forward pass is done)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, nh, T, hs) after the cached positions; returns all keys and values so far."""
        end = self.pos + k.size(2)
        self.k[layer, :, :, self.pos : end] = k
        self.v[layer, :, :, self.pos : end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]  # (B, nh, end, hs)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.n_embd = cfg.n_head, cfg.n_embd
        # Separate projections (GPT-2 fuses them into one c_attn): tensor parallelism splits each
        # by heads (columns), which a fused matrix would mix up across q, k and v.
        self.c_q = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_k = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_v = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj.residual_scale = True  # marked for GPT-2's scaled init
        self.dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        B, T, C = x.shape
        hs = C // self.n_head
        # nh: this rank's heads (all of them, or n_head / N under N-way tensor parallelism)
        q = self.c_q(x).view(B, T, -1, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.c_k(x).view(B, T, -1, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = self.c_v(x).view(B, T, -1, hs).transpose(1, 2)  # (B, nh, T, hs)
        causal = True
        if cache is not None:
            # The cache holds every earlier position: one new query may see them all; a first pass
            # over T > 1 positions starts from an empty cache, so its mask is the causal one.
            causal = cache.pos == 0 and T > 1
            k, v = cache.append(layer, k, v)  # 2 x (B, nh, pos + T, hs)
        # is_causal builds the mask inside the kernel (flash attention on GPU); a float mask
        # would be *added* to the scores, which is how other codebases leaked the future.
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=causal
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)  # (B, T, nh * hs)
        return self.resid_drop(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj.residual_scale = True
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)
        self.checkpointed = False  # GPT.checkpoint_activations

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        if self.checkpointed and cache is None and torch.is_grad_enabled():
            # Only the block's input is kept for the backward, which runs the forward again (the same
            # dropout noise: the RNG state is kept too) to get the rest: about a third more compute for
            # the block's activations. Non-reentrant: the one form that FSDP2, DTensor and compile support.
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x, cache, layer)

    def _forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache, layer)
        return x + self.mlp(self.ln_2(x))


class RealVocab(nn.Module):
    """The logits of the real vocabulary: the padded columns sliced off, so that padding ids can
    never be predicted or sampled. (Tensor parallelism swaps it for a mask of those columns, which
    keeps logits split by vocabulary: mingpt/parallel/tensor.py.)"""

    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return logits[..., : self.size]


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.vocab_size <= 0 or cfg.block_size <= 0:
            raise ValueError("GPTConfig.vocab_size and block_size must be set (from the tokenizer and "
                             "data.block_size) before building the model")
        cfg = cfg.resolved()
        self.config = cfg
        V = cfg.padded_vocab_size
        # On the meta device (parallelize initialises later) no value is drawn: normal_ on a meta
        # tensor goes through torch._refs, whose first call imports torch._dynamo (1 s per process).
        meta = torch.empty(0).is_meta
        self.wte = nn.Embedding(V, cfg.n_embd, _weight=torch.empty(V, cfg.n_embd) if meta else None)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd,
                                _weight=torch.empty(cfg.block_size, cfg.n_embd) if meta else None)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, V, bias=False)
        self.real_vocab = RealVocab(cfg.vocab_size)
        self.tie_weights()
        if not meta:  # built in place: initialised by the same path, seeded from torch's generator
            self.init_weights(int(torch.randint(2**62, ())))

    def tie_weights(self) -> None:
        """One matrix embeds tokens and predicts them, as in GPT-2 (again after `to_empty`, which
        gives every module its own new parameters)."""
        self.lm_head.weight = self.wte.weight

    def init_weights(self, seed: int) -> None:
        """GPT-2's initialisation, the one path on every device and under every strategy: each
        parameter is drawn whole on CPU from a generator of `seed`, module by module, and each rank
        keeps its rows (`assign`), so the values depend on the seed alone. Linear and embedding
        weights are N(0, 0.02), the residual projections scaled by 1/sqrt(2 * n_layer) (each residual
        branch adds to the stream); biases 0; LayerNorm 1 and 0. The tied matrix is drawn once."""
        gen, done = torch.Generator().manual_seed(seed), set()
        for m in self.modules():
            if isinstance(m, nn.LayerNorm):
                assign(m.weight, torch.ones(m.weight.shape))
                if m.bias is not None:
                    assign(m.bias, torch.zeros(m.bias.shape))
            elif isinstance(m, (nn.Linear, nn.Embedding)) and id(m.weight) not in done:
                done.add(id(m.weight))
                std = 0.02 * ((2 * self.config.n_layer) ** -0.5 if getattr(m, "residual_scale", False) else 1)
                assign(m.weight, nn.init.normal_(torch.empty(m.weight.shape), 0.0, std, generator=gen))
                if getattr(m, "bias", None) is not None:
                    assign(m.bias, torch.zeros(m.bias.shape))

    def checkpoint_activations(self, on: bool = True) -> None:
        """Activation checkpointing per block: each block keeps only its input for the backward and
        recomputes the rest there (whatever layout holds the blocks: a pipeline stage runs these modules)."""
        for block in self.blocks:
            block.checkpointed = on

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; the position embedding is left out by default (it does no matmul)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward), PaLM appendix B: 6N + 12 L H Q T."""
        c = self.config
        return 6.0 * self.num_params() + 12.0 * c.n_layer * c.n_head * (c.n_embd // c.n_head) * seq_len

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, reduction: str = "mean",
        cache: KVCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits over the real vocabulary and, with targets, the cross-entropy loss.

        Args:
            idx: token ids, (B, T) with T <= block_size.
            targets: next-token ids, (B, T); -100 marks positions that do not count (padding).
            reduction: "mean" over counted tokens, or "sum" (the trainer normalises globally).
            cache: for generation: idx continues the positions held in the cache, which grows by T.
        """
        B, T = idx.shape
        start = cache.pos if cache is not None else 0
        if start + T > self.config.block_size:
            raise ValueError(f"sequence length {start + T} exceeds the model's block_size {self.config.block_size}")
        pos = torch.arange(start, start + T, device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for layer, block in enumerate(self.blocks):
            x = block(x, cache, layer)
        if cache is not None:
            cache.pos += T
        x = self.ln_f(x)  # (B, T, C)
        logits = self.real_vocab(self.lm_head(x))  # (B, T, V)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(
            logits.reshape(-1, logits.size(-1)).float(),  # (B*T, V)
            targets.reshape(-1),  # (B*T,)
            ignore_index=-100,
            reduction=reduction,
        )
        return logits, loss
