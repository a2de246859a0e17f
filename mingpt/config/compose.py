"""Hydra composition in one place: conf/ plus command-line overrides -> the typed RunConfig.

Every default lives in the dataclasses of schema.py, registered with Hydra's ConfigStore as the
schema `mingpt` (so the YAML files in conf/ hold only what differs from the defaults, and an
unknown key or a wrong type is refused when composing); the model presets are model/gpt.py's PRESETS
table (and CUSTOM), registered as the options of the `model` group. main.py, the benchmarks and the tests all
compose through `compose`; Hydra's errors become one `ConfigError` line that says what to type.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import re
import typing
from pathlib import Path
from typing import Any

from mingpt.config.schema import ConfigError, RunConfig
from mingpt.model.gpt import CUSTOM, PRESETS, GPTConfig


def config_dir() -> str:
    """conf/ of a source checkout, else the copy installed inside the package."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent.parent / "conf", here.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return str(candidate)
    raise FileNotFoundError("mingpt's conf/ directory is missing from this installation")


def register() -> None:
    """Put the schema and the model presets into Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(name="mingpt", node=_writable(RunConfig))
    for name in PRESETS:
        store.store(group="model", name=name, node=_writable(GPTConfig(preset=name)))
    store.store(group="model", name="custom", node=_writable(CUSTOM))


def _writable(obj):
    """A typed OmegaConf node of a (frozen) dataclass that overrides may still change."""
    from omegaconf import DictConfig, OmegaConf

    def unfreeze(node):
        OmegaConf.set_readonly(node, None)  # frozen dataclasses make every nested node read-only
        for key in node.keys():
            child = node._get_node(key)
            if isinstance(child, DictConfig):
                unfreeze(child)

    node = OmegaConf.structured(obj)
    unfreeze(node)
    return node


def compose(overrides: list[str]) -> RunConfig:
    """The run's config from conf/config.yaml and Hydra overrides such as `model=gpt2 trainer.max_steps=10`."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    register()
    try:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
            values = OmegaConf.to_container(hydra_compose("config", overrides=overrides), resolve=True)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(explain(e)) from None
    return from_dict(values)


def explain(e: Exception) -> str:
    """Hydra's multi-line error as one line, with the key the user probably meant."""
    text = str(e)
    m = re.search(r"Could not override '([^']+)'", text)
    if m and ("To append to your config" in text or "not in struct" in text):
        key = m.group(1)
        close = suggest_key(key)
        hint = f" (did you mean {close}?)" if close else ""
        return f"unknown config key {key}{hint}; `python -m mingpt.main --cfg job` lists every key"
    m = re.search(r"Could not find '([^/']+)/([^']+)'", text)
    if m:
        group, option = m.groups()
        # Hydra lists them one a line, then its search path
        listed = text.split("Available options", 1)[-1].split("Config search path", 1)[0].splitlines()[1:]
        options = sorted({line.strip() for line in listed if line.startswith(("\t", " ")) and line.strip()})
        return f"{group}={option} is not a config option of {group}; choose one of: {', '.join(options)}"
    cause = str(e.__cause__).splitlines()[0] if e.__cause__ is not None and str(e.__cause__) else ""
    lines = [line.strip() for line in text.splitlines() if line.strip()][:3] + ([cause] if cause else [])
    return "; ".join(lines) + " (check the command-line overrides)"


# Hydra's own flags (`--cfg job`, `--help`): what a dash may start on the command line.
HYDRA_FLAGS = {"--cfg", "-c", "--help", "-h", "--hydra-help", "--version", "--package", "-p", "--resolve",
               "--info", "-i", "--run", "-r", "--multirun", "-m", "--shell-completion", "-sc", "--config-path", "-cp",
               "--config-name", "-cn", "--config-dir", "-cd", "--experimental-rerun"}


def dashed_settings(overrides: list[str], refuse: bool = False) -> list[str]:
    """Settings written with dashes, nanoGPT's habit (`--max_steps=10`), which Hydra would answer with
    its usage, once per rank; with `refuse`, a ConfigError naming the key meant."""
    dashed = [a for a in overrides if a.startswith("-") and a.split("=")[0] not in HYDRA_FLAGS]
    if dashed and refuse:
        key, _, value = dashed[0].lstrip("-").partition("=")
        close = suggest_key(key.replace("-", "_"))
        raise ConfigError(f"{dashed[0]}: settings are written without dashes, key=value"
                          + (f" (did you mean {close}={value or '...'}?)" if close else
                             " (python -m mingpt.main --cfg job lists every key)"))
    return dashed


def summary(cfg: RunConfig, world_size: int = 1) -> list[str]:
    """The settings a user checks before a long run on `world_size` processes, on one screen (`--cfg job`
    prints every key)."""
    m, d, o, t, s, r = cfg.model, cfg.data, cfg.optim, cfg.trainer, cfg.snapshot, cfg.replicas
    micro = str(cfg.for_world(world_size).trainer.micro_batch)
    optimizer = "Muon (the blocks' matrices) + AdamW" if t.optimizer == "muon" else "AdamW"
    if not t.micro_batch_size:
        micro += " (chosen: a micro-batch per stage for each pipeline)" if t.pipeline_parallel > 1 else " (chosen)"
    steps = f"{t.max_steps} steps, evaluated every {t.eval_every} on {t.eval_iters} batches" if t.eval_every else \
        f"{t.max_steps} steps, no evaluation"
    batch = (f"{t.batch_size} sequences of {d.block_size} tokens a step, micro-batches of {micro}"
             if d.kind == "stream" else f"documents, {d.documents.micro_batches_per_step} micro-batches of "
             f"{d.documents.token_budget} tokens a step")
    layers, heads, width = m.shape
    return [f"model     {m.preset or 'custom'}: {layers} layers, {heads} heads, {width} wide"
            + (f", from {m.init_from}" if m.init_from else ""),
            f"data      {d.path} ({d.tokenizer.kind} tokens), {d.val_fraction:.0%} held out for validation",
            f"batch     {batch}", f"steps     {steps}, logged every {t.log_every}",
            f"optimizer {optimizer}, lr {o.lr:g} (warm-up {o.warmup_steps} steps, cosine to {o.min_lr:g}), weight decay "
            f"{o.weight_decay:g}, clip {o.grad_clip:g}",
            f"layout    {t.parallel}" + (f", tensor parallel {t.tensor_parallel}" if t.tensor_parallel > 1 else "")
            + (f", pipeline {t.pipeline_parallel} ({t.pipeline_schedule})" if t.pipeline_parallel > 1 else "")
            + f", precision {t.precision}" + (", compiled" if t.compile else "")
            + (", activation checkpointing" if t.activation_checkpointing else "")
            + (f", replica group {r.group} of {len(r.peers)}" if r.enabled else ""),
            f"snapshots {cfg.snapshot_store}, every {s.every_steps} steps"
            + (f" or {s.every_seconds:g} s" if s.every_seconds else "") + f", keep {s.keep_last}, resume {s.resume}",
            f"run       {t.run_dir} (metrics.jsonl; a report: mingpt-report {t.run_dir})"
            + (f", tracked by {t.tracker} ({t.tracker_project})" if t.tracker != "none" else "")]


def _build(cls, values: dict[str, Any], where: str):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    types = typing.get_type_hints(cls)
    unknown = sorted(set(values) - set(fields))
    if unknown:
        close = suggest_key(where + unknown[0])
        raise ConfigError(f"unknown config key(s) {', '.join(where + k for k in unknown)}"
                          + (f" (did you mean {close}?)" if close else ""))
    kwargs = {}
    for name, value in values.items():
        if dataclasses.is_dataclass(types[name]):  # a nested section: its own dataclass
            value = _build(types[name], dict(value or {}), f"{where}{name}.")
        elif isinstance(value, list):
            value = tuple(value)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as e:  # the component's own check: its message names the key
        raise ConfigError(str(e)) from None
    except TypeError as e:
        raise ConfigError(f"{where.rstrip('.') or 'config'}: {e}") from None


def known_keys(cls=None, prefix: str = "") -> list[str]:
    """Every settable key of the run's config, dotted (e.g. data.documents.token_budget)."""
    cls = cls or RunConfig
    types = typing.get_type_hints(cls)
    keys = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(types[f.name]):
            keys += known_keys(types[f.name], f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def suggest_key(key: str) -> str | None:
    """The key a mistyped or moved one probably means: the same name elsewhere, else the closest."""
    keys = known_keys()
    moved = [k for k in keys if k.rsplit(".", 1)[-1] == key.rsplit(".", 1)[-1]]
    if len(moved) == 1:
        return moved[0]
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    return close[0] if close else None


def from_dict(values: dict[str, Any]) -> RunConfig:
    """Build and validate the run's config from plain (already resolved) containers."""
    cfg = _build(RunConfig, dict(values), "")
    check_extras(cfg)
    return cfg


# The optional extras (pyproject.toml) that a setting needs in training: (the setting, whether the
# config asks for it, the module, the extra). `report` (matplotlib) is mingpt-report's alone, and
# Parquet (pyarrow) mingpt-prepare's: training reads text and JSON lines.
EXTRAS = (
    ("trainer.tensorboard=true", lambda cfg: cfg.trainer.tensorboard, "tensorboard", "tensorboard"),
    ("a zstd-compressed corpus (data.path=*.zst)", lambda cfg: cfg.data.path.endswith(".zst"), "zstandard",
     "formats"),
    ("snapshot.uploader=boto3", lambda cfg: cfg.snapshot.uploader == "boto3", "boto3", "boto3"),
    ("trainer.tracker=wandb", lambda cfg: cfg.trainer.tracker == "wandb", "wandb", "wandb"),
    ("trainer.tracker=mlflow", lambda cfg: cfg.trainer.tracker == "mlflow", "mlflow", "mlflow"),
)


def check_extras(cfg: RunConfig) -> None:
    """Refuse a setting whose optional extra is not installed, before anything is built (it would
    fail minutes later, once the corpus and the model are)."""
    for setting, wanted, module, extra in EXTRAS:
        if not wanted(cfg):
            continue
        try:
            importlib.import_module(module)
        except ImportError:
            raise ConfigError(f"{setting} needs {module}, which is not installed: pip install 'mingpt[{extra}]' "
                              f"(in a checkout: pip install -e '.[{extra}]')") from None
