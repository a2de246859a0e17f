import dataclasses
import re
import sys
from pathlib import Path

import pytest
import yaml

from mingpt.config.compose import compose, config_dir, from_dict, summary
from mingpt.config.schema import ConfigError
from mingpt.model.gpt import PRESETS

GROUPS = sorted(p.name for p in Path(config_dir()).iterdir() if p.is_dir())
OPTIONS = ([(g, p.stem) for g in GROUPS for p in sorted((Path(config_dir()) / g).glob("*.yaml"))]
           + [("model", name) for name in [*PRESETS, "custom"]])


def test_config_files_hold_only_what_differs_from_the_defaults():
    """Every default is defined once, in config/schema.py; the model presets once, in model/gpt.py's PRESETS."""
    assert GROUPS == ["data", "experiment", "snapshot", "trainer"]
    defaults = from_dict({})
    for group, option in OPTIONS:
        if group in ("model", "experiment"):  # presets in PRESETS; recipes set keys across sections
            continue
        values = yaml.safe_load((Path(config_dir()) / group / f"{option}.yaml").read_text()) or {}
        section = dataclasses.asdict(getattr(defaults, group))

        def same(v, d, where):
            for k, x in v.items():
                if isinstance(x, dict):
                    same(x, d[k], f"{where}{k}.")
                else:
                    assert x != d[k], f"{group}={option} repeats the default {where}{k}={x!r}"

        same(values, section, f"{group}.")
    assert compose(["model=gpt2"]).model.shape == PRESETS["gpt2"]


@pytest.mark.parametrize("group, option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_group_option_composes_into_typed_config(group, option):
    cfg = compose([f"{group}={option}"])
    assert cfg.model.block_size == 0 and cfg.data.block_size > 0  # the context is set in one place
    if group != "experiment":
        assert getattr(cfg, group) != getattr(from_dict({}), group) or option in ("shakespeare_char", "gpt-mini")
    else:
        assert cfg.model.init_from == "gpt2" and cfg.data.tokenizer.kind == "bpe" and cfg.optim.lr == cfg.optim.min_lr
    if group == "model" and option != "custom":
        assert cfg.model.preset == option


def test_command_line_overrides():
    cfg = compose(["trainer.max_steps=200", "model=gpt-micro", "optim.betas=[0.9,0.95]"])
    assert cfg.trainer.max_steps == 200 and cfg.model.shape == (4, 4, 128) and cfg.optim.betas == (0.9, 0.95)


@pytest.mark.parametrize("overrides, message", [
    (["model.n_head=5"], "n_embd=192 is not divisible by model.n_head=5"),
    (["model.block_size=512"], "model.block_size=512 cannot be set on its own.*set data.block_size=512"),
    (["trainer.max_steps=ten"], r"trainer.max_steps=ten; Value 'ten' of type 'str' could not be converted to Integer"),
    (["data.token_budget=8"], r"unknown config key data.token_budget \(did you mean data.documents.token_budget\?\)"),
    (["data.documents.token_budget=8"], r"data.documents.\* settings apply to data.kind=documents only"),
    (["data=shakespeare_speeches", "trainer.batch_size=8"], "documents are batched by data.documents.token_budget"),
    (["data.tokenizer.ranks_file=r50k_base.tiktoken"],
     r"^data.tokenizer.ranks_file applies to data.tokenizer.kind=bpe only .*add data.tokenizer.kind=bpe"),
    (["data=shakespeare_speeches", "data.documents.text_field=body"],
     r"^data.documents.text_field applies to data.documents.format=jsonl only \(it is text\)"),
    (["data=shakespeare_speeches", "data.documents.format=jsonl", "data.documents.separator=---"],
     r"^data.documents.separator applies to data.documents.format=text only \(it is jsonl\)"),
    (["trainer.micro_batch_size=-1"], r"trainer.batch_size must be positive and micro_batch_size >= 0 \(0 = chosen\)"),
    (["snapshot.resume=yes"], "snapshot.resume='yes': use latest, never, or the path"),
    (["model.preset=gpt-5"], "not a known preset"),
    (["trainer.precision=fp8"], "trainer.precision='fp8'"),
    (["trainer.readable_by=everyone"], "^trainer.readable_by='everyone': use user, group or all$"),
    (["+trainer.batchsize=3"], r"unknown config key\(s\) trainer.batchsize \(did you mean trainer.batch_size\?\)"),
    (["trainer.max_step=5"], r"^unknown config key trainer.max_step \(did you mean trainer.max_steps\?\)"),
    (["model=gpt3"], r"^model=gpt3 is not a config option of model; choose one of: custom, gopher-44m, gpt-micro"),
    (["trainer.max_steps=[1"], r"\(check the command-line overrides\)$"),
])
def test_invalid_values_stop_with_one_clear_message(overrides, message):
    with pytest.raises(ConfigError, match=message):
        compose(overrides)


def test_the_settings_a_run_starts_with_fit_one_screen_and_name_what_a_user_checks():
    cfg = compose(["model=gpt-micro", "trainer.max_steps=300", "trainer.run_dir=runs/micro"])
    lines = summary(cfg)
    assert len(lines) <= 12 and all(len(line) <= 120 for line in lines)
    text = "\n".join(lines)
    for said in ("gpt-micro: 4 layers, 4 heads, 128 wide", "data/input.txt (char tokens)", "32 sequences of 128 tokens",
                 "300 steps, evaluated every 250", "lr 0.001", "runs/micro/snapshots, every 500 steps",
                 "mingpt-report runs/micro"):
        assert said in text, said


@pytest.mark.parametrize("overrides, module, extra", [
    (["trainer.tensorboard=true"], "tensorboard", "tensorboard"),
    (["data.path=corpus.jsonl.zst"], "zstandard", "formats"),
    (["snapshot.uploader=boto3"], "boto3", "boto3"),  # an extra since a user install took 5 min resolving it
    (["trainer.tracker=wandb"], "wandb", "wandb"),
    (["trainer.tracker=mlflow"], "mlflow", "mlflow"),
])
def test_a_setting_whose_extra_is_not_installed_is_refused_when_composing(tmp_path, monkeypatch, overrides, module,
                                                                          extra):
    """Before: trainer.tensorboard=true without TensorBoard failed in a traceback once the corpus and the
    model were built. A shadow package that raises ImportError stands for the extra not installed."""
    assert compose(overrides)  # installed (the test extras): accepted
    (tmp_path / module).mkdir()
    (tmp_path / module / "__init__.py").write_text(f"raise ImportError('No module named {module}')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)
    key = re.escape(overrides[0].split("=")[0])
    with pytest.raises(ConfigError, match=rf"{key}.* needs {module}, which is not installed: pip install 'mingpt\[{extra}\]'"):
        compose(overrides)
    assert compose([]).trainer.tensorboard is False  # a setting that needs no extra never asks for it
