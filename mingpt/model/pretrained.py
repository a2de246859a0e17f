"""GPT-2 weights in Hugging Face's layout, in and out. Our GPT is GPT-2: the same parameters under
other names, and Hugging Face's Conv1D layers store their weights transposed (in, out).

    read_gpt2(dir)          config.json + model.safetensors of a GPT-2 checkpoint -> shape, our state
    locate(name_or_dir)     a local directory, or a hub name downloaded through huggingface_hub's cache
    write_gpt2(dir, ...)    the other way: a directory that transformers' GPT2LMHeadModel loads
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import replace
from pathlib import Path

import torch

from mingpt.config.schema import ConfigError, RunConfig
from mingpt.parallel.shards import assign
from mingpt.runtime import distributed
from mingpt.runtime.distributed import DistInfo

log = logging.getLogger(__name__)

HUB_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# The parameters of one transformer block, under the same names in both layouts (h.N / blocks.N),
# but for attention's input projection: Hugging Face's one c_attn (q | k | v) is our c_q, c_k, c_v.
LAYER_PARAMS = ("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias", "attn.c_attn.weight", "attn.c_attn.bias",
                "attn.c_proj.weight", "attn.c_proj.bias", "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight",
                "mlp.c_proj.bias")
QKV = ("attn.c_q", "attn.c_k", "attn.c_v")
# Hugging Face's Conv1D keeps weights as (in, out); nn.Linear as (out, in).
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


class PretrainedError(RuntimeError):
    """Pretrained weights cannot be used; the message says why and what to do."""


def locate(name_or_dir: str, download: bool = True) -> Path:
    """The local directory of a checkpoint: the path itself, or a hub name from huggingface_hub's
    cache (downloaded when `download`, else only looked up: the other processes of a node wait
    for the first one to download, then find it in the cache)."""
    path = Path(os.path.expanduser(name_or_dir))
    if path.exists():
        if not path.is_dir():
            raise PretrainedError(f"model.init_from={name_or_dir} is a file; point it at the directory that "
                                  "holds config.json and model.safetensors")
        return path
    if name_or_dir.startswith((".", "/", "~")) or os.sep + os.sep in name_or_dir:
        raise PretrainedError(f"model.init_from={name_or_dir}: no such directory")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise PretrainedError("model.init_from names a hub model, which needs huggingface_hub: "
                              "pip install huggingface_hub (or point init_from at a local directory)") from None
    try:
        return Path(snapshot_download(name_or_dir, allow_patterns=["config.json", "model.safetensors"],
                                      local_files_only=not download))
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, no permission: one message for all
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
        first = (str(e).splitlines() or [""])[0].split(". ")[0][:200]  # its first sentence, not half of one
        why = "HF_HUB_OFFLINE is set" if offline else f"{e.__class__.__name__}: {first}"
        raise PretrainedError(
            f"cannot get {name_or_dir!r} from the Hugging Face hub ({why}). On a machine with internet run "
            f"`huggingface-cli download {name_or_dir} config.json model.safetensors --local-dir DIR`, copy DIR "
            f"here and set model.init_from=DIR (the hub's GPT-2 names: {', '.join(HUB_NAMES)})") from None


def read_config(directory: Path) -> dict:
    """The GPT-2 shape of a checkpoint directory: n_layer, n_head, n_embd, n_positions, vocab_size."""
    path = directory / "config.json"
    if not path.is_file():
        raise PretrainedError(f"{directory} has no config.json: it is not a Hugging Face checkpoint")
    config = json.loads(path.read_text())
    kind = config.get("model_type")
    if kind != "gpt2":
        arch = ", ".join(config.get("architectures") or []) or "unknown architecture"
        raise PretrainedError(f"{directory} holds a {kind!r} model ({arch}); model.init_from takes GPT-2 "
                              "checkpoints (model_type gpt2), whose layers mingpt's GPT shares")
    if config.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise PretrainedError(f"{directory}: activation {config['activation_function']!r} is not GPT-2's tanh GELU")
    return {k: int(config[k]) for k in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size")}


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Hugging Face's GPT-2 tensors (names without the `transformer.` prefix)."""
    if (directory / "model.safetensors").is_file():
        from safetensors.torch import load_file

        tensors = load_file(str(directory / "model.safetensors"))
    elif (directory / "pytorch_model.bin").is_file():  # pickled: only tensors may come out of it
        tensors = torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise PretrainedError(f"{directory} has no {' or '.join(WEIGHT_FILES)}: copy the weights next to its "
                              "config.json")
    return {k.removeprefix("transformer."): v for k, v in tensors.items()}


def to_ours(hf: dict[str, torch.Tensor], n_layer: int) -> dict[str, torch.Tensor]:
    """Hugging Face's names and layouts -> our GPT's (blocks.N for h.N, Linear for Conv1D)."""
    out = {"wte.weight": hf["wte.weight"], "wpe.weight": hf["wpe.weight"],
           "ln_f.weight": hf["ln_f.weight"], "ln_f.bias": hf["ln_f.bias"]}
    for i in range(n_layer):
        for name in LAYER_PARAMS:
            t = hf[f"h.{i}.{name}"]
            t = t.t() if name in CONV1D else t
            if name.startswith("attn.c_attn."):  # (3C, ...): q, k and v one after the other
                for part, piece in zip(QKV, t.chunk(3)):
                    out[f"blocks.{i}.{part}.{name.rsplit('.', 1)[1]}"] = piece
            else:
                out[f"blocks.{i}.{name}"] = t
    return out


def load_into(model: torch.nn.Module, directory: Path) -> None:
    """Copy a GPT-2 checkpoint into our GPT of the same shape (the first block_size positions; the
    padded vocabulary rows keep their initial values: they are never input nor predicted)."""
    ours = to_ours(read_weights(directory), model.config.n_layer)
    own = dict(model.named_parameters())
    for name, t in ours.items():
        target = own[name]
        if name in ("wte.weight", "wpe.weight"):  # (vocab or positions, C): the leading rows
            assign(target, t[: target.shape[0]])
        else:
            if tuple(target.shape) != tuple(t.shape):
                raise PretrainedError(f"{directory}: {name} has shape {tuple(t.shape)}, the model "
                                      f"{tuple(target.shape)}")
            assign(target, t)


def write_gpt2(directory: Path, model_state: dict[str, torch.Tensor], shape: dict, extra: dict | None = None) -> None:
    """A Hugging Face GPT-2 checkpoint (config.json + model.safetensors) of our model's weights."""
    from safetensors.torch import save_file

    vocab, n_layer = shape["vocab_size"], shape["n_layer"]
    tensors = {"transformer.wte.weight": model_state["wte.weight"][:vocab],
               "transformer.wpe.weight": model_state["wpe.weight"],
               "transformer.ln_f.weight": model_state["ln_f.weight"], "transformer.ln_f.bias": model_state["ln_f.bias"]}
    for i in range(n_layer):
        for name in LAYER_PARAMS:
            if name.startswith("attn.c_attn."):
                kind = name.rsplit(".", 1)[1]
                t = torch.cat([model_state[f"blocks.{i}.{part}.{kind}"] for part in QKV])
            else:
                t = model_state[f"blocks.{i}.{name}"]
            tensors[f"transformer.h.{i}.{name}"] = t.t() if name in CONV1D else t
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in tensors.items()}
    config = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": vocab,
        "n_positions": shape["block_size"], "n_ctx": shape["block_size"], "n_embd": shape["n_embd"],
        "n_layer": n_layer, "n_head": shape["n_head"], "n_inner": None, "activation_function": "gelu_new",
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02, "tie_word_embeddings": True, "bos_token_id": vocab - 1, "eos_token_id": vocab - 1,
        "torch_dtype": "float32", **(extra or {}),
    }
    directory.mkdir(parents=True, exist_ok=True)
    # lm_head.weight is wte.weight (tied): transformers ties them again on load, as save_pretrained does.
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # safetensors makes its file private (0600); an export is for sharing: a new file's usual mode
    # (0666 less the umask), which config.json has just got
    shutil.copymode(directory / "config.json", directory / "model.safetensors")


def pretrained_checkpoint(name: str, info: DistInfo) -> Path:
    """The checkpoint's directory: the first process of each node downloads it (once, into the hub's
    cache); the others wait for it, then read the same files."""
    path, error = None, None
    if info.local_rank == 0:
        try:
            path = locate(name, download=True)
        except PretrainedError as e:
            error = e
    distributed.barrier()
    if error is not None:
        raise error
    return path if path is not None else locate(name, download=False)


def with_pretrained_shape(cfg: RunConfig, directory: Path) -> RunConfig:
    """The run's config with the model shape of a GPT-2 checkpoint."""
    hf = read_config(directory)
    if cfg.data.block_size > hf["n_positions"]:
        raise ConfigError(f"data.block_size={cfg.data.block_size} is longer than the context of "
                          f"{cfg.model.init_from} ({hf['n_positions']}); lower data.block_size")
    log.info("model shape from %s: %d layers, %d heads, %d wide", cfg.model.init_from, hf["n_layer"], hf["n_head"],
             hf["n_embd"])
    return replace(cfg, model=replace(cfg.model, preset=None, n_layer=hf["n_layer"], n_head=hf["n_head"],
                                      n_embd=hf["n_embd"], bias=True))
