"""Hydra composition in one place: conf/ plus command-line overrides -> the typed RunConfig.

main.py, the benchmarks and the tests all compose through `compose`, so a config means the same
everywhere; Hydra's errors become one `ConfigError` line that says what to type instead.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from pathlib import Path

from mingpt.config import ConfigError, RunConfig, from_dict


def config_dir() -> str:
    """conf/ of a source checkout, else the copy installed inside the package."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "conf", here / "conf"):
        if (candidate / "config.yaml").is_file():
            return str(candidate)
    raise FileNotFoundError("mingpt's conf/ directory is missing from this installation")


def compose(overrides: list[str]) -> RunConfig:
    """The run's config from conf/config.yaml and Hydra overrides such as `model=gpt2 trainer.max_steps=10`."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
            values = OmegaConf.to_container(hydra_compose("config", overrides=overrides), resolve=True)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(explain(e)) from None
    return from_dict(values)


def _known_keys() -> list[str]:
    keys = []

    def walk(cls, prefix):
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
                walk(f.default_factory, f"{prefix}{f.name}.")
            else:
                keys.append(prefix + f.name)

    walk(RunConfig, "")
    return keys


def explain(e: Exception) -> str:
    """Hydra's multi-line error as one line, with the key the user probably meant."""
    text = str(e)
    m = re.search(r"Could not override '([^']+)'", text)
    if m and ("To append to your config" in text or "not in struct" in text):
        key = m.group(1)
        close = difflib.get_close_matches(key, _known_keys(), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]}?)" if close else ""
        return f"unknown config key {key}{hint}; `python -m mingpt.main --cfg job` lists every key"
    m = re.search(r"Could not find '([^/']+)/([^']+)'", text)
    if m:
        group, option = m.groups()
        options = sorted(p.stem for p in (Path(config_dir()) / group).glob("*.yaml"))
        return f"{group}={option} is not a config option of {group}; choose one of: {', '.join(options)}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return "; ".join(lines[:3]) + " (check the spelling of the command-line overrides)"
