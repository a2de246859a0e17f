from pathlib import Path

import pytest

from mingpt.bench import compose_config
from mingpt.config import ConfigError
from mingpt.distributed import DistInfo, default_threads
from mingpt.main import config_dir

GROUPS = sorted(p.name for p in Path(config_dir()).iterdir() if p.is_dir())
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((Path(config_dir()) / g).glob("*.yaml"))]


def test_all_groups_present():
    assert GROUPS == ["data", "model", "optim", "snapshot", "trainer"]


@pytest.mark.parametrize("group, option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_group_option_composes_into_typed_config(group, option):
    cfg = compose_config([f"{group}={option}"])
    assert cfg.data.block_size <= cfg.model.block_size
    if group == "model" and option != "custom":
        assert cfg.model.preset == option


def test_command_line_overrides():
    cfg = compose_config(["trainer.max_steps=200", "model=gpt-micro", "optim.betas=[0.9,0.95]"])
    assert cfg.trainer.max_steps == 200 and cfg.model.shape == (4, 4, 128) and cfg.optim.betas == (0.9, 0.95)


@pytest.mark.parametrize("overrides, message", [
    (["model.n_head=5"], "n_embd=192 is not divisible by model.n_head=5"),
    (["data.block_size=512"], "data.block_size=512 exceeds model.block_size=256"),
    (["model.preset=gpt-5"], "not a known preset"),
    (["trainer.precision=fp8"], "trainer.precision='fp8'"),
    (["+trainer.batchsize=3"], "unknown config key.*trainer.batchsize"),
])
def test_invalid_values_stop_with_one_clear_message(overrides, message):
    with pytest.raises(ConfigError, match=message):
        compose_config(overrides)


def test_dist_info_from_env_without_process_group():
    info = DistInfo.from_env({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                              "GROUP_RANK": "1", "TORCHELASTIC_RESTART_COUNT": "2"}, cuda=False)
    assert (info.rank, info.local_rank, info.world_size, info.node_rank, info.restart_count) == (3, 1, 4, 1, 2)
    assert info.device == "cpu" and info.backend == "gloo" and not info.is_first
    gpu = DistInfo.from_env({"LOCAL_RANK": "1"}, cuda=True)
    assert gpu.device == "cuda:1" and gpu.backend == "nccl"
    plain = DistInfo.from_env({}, cuda=False)
    assert plain.is_first and not plain.distributed
    assert default_threads(2) >= 1 and default_threads(1) >= default_threads(2)
