import dataclasses
import re
from pathlib import Path
from typing import get_args

import pytest
import yaml
from omegaconf import OmegaConf

from ppo_core.config import (
    CHOICES,
    Config,
    ConfigError,
    field_docs,
    flatten,
    load_config,
    save_config,
    to_yaml,
)
from ppo_core.math.kl import KL_ESTIMATORS
from ppo_core.math.losses import LOSS_AGG_MODES


def test_defaults_load_and_nest(tmp_path):
    config = load_config()
    save_config(config, tmp_path / "defaults.yaml")  # a saved config loads back unchanged
    assert to_yaml(load_config(tmp_path / "defaults.yaml")) == to_yaml(config)
    assert (
        config.ppo.rollout_batch_size >= config.ppo.mini_batch_size >= config.ppo.micro_batch_size
    )
    assert config.generation.top_k == 0 and config.generation.top_p == 1.0


def test_file_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("seed: 5\nppo:\n  epochs: 2\noptim:\n  lr: 0.001\n")
    config = load_config(path, ["ppo.epochs=3"])
    assert (config.seed, config.ppo.epochs, config.optim.lr) == (5, 3, 0.001)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["ppo.micro_bach_size=4"],
            r"unknown config key 'ppo.micro_bach_size'.*Did you mean 'ppo.micro_batch_size'",
        ),
        (["optim.lr=fast"], r"bad value for config key 'optim.lr'.*'fast'"),
        (["seed=1.5"], r"config key 'seed'"),
        (
            ["ppo.micro_batch_size=6"],
            r"^ppo.micro_batch_size=6 does not divide ppo.mini_batch_size=16; choose a divisor",
        ),
        (
            ["ppo.mini_batch_size=128"],
            r"^ppo.mini_batch_size=128 is larger than ppo.rollout_batch_size=64; sizes must nest",
        ),
        (
            ["ppo.rollout_batch_size=60"],
            r"^ppo.mini_batch_size=16 does not divide ppo.rollout_batch_size=60 .* set "
            r"ppo.drop_last",
        ),
        (["ppo.micro_batch_size=0"], r"^ppo.micro_batch_size must be a positive integer, got 0$"),
        (
            ["ppo=5"],
            r"^bad value for config key 'ppo' \(override 'ppo=5'\): a section of keys, not a "
            r"value \(got 5\); set the keys inside it, e.g. ppo.rollout_batch_size=64$",
        ),
        (
            ["optim=[1]"],
            r"^bad value for config key 'optim' \(override 'optim=\[1\]'\): a section of keys, "
            r"not a value \(got \[1\]\); set the keys inside it, e.g. optim.name=adamw$",
        ),
        (["base=x"], r"^bad value for config key 'base' .* e.g. base.source=null$"),
        (["kl.estimator=k7"], r"kl.estimator='k7' is not one of k1, k2, k3, abs"),
        (["optim.name=lion"], r"optim.name='lion' is not one of adamw, sgd"),
        (["ppo.loss_agg_mode=mean"], r"ppo.loss_agg_mode='mean'"),
        (["ppo.epochs=0"], r"ppo.epochs must be > 0, got 0"),
        (["ppo.lam=1.5"], r"ppo.lam must be in \[0, 1\], got 1.5"),
        (["generation.top_p=0"], r"generation.top_p must be in \(0, 1\]"),
        (["device=tpu"], r"device='tpu' is not one of auto, cpu, cuda"),
        (
            ["ppo.loss_agg_mode=mean"],
            r"not one of token-mean, seq-mean-token-mean, seq-mean-token-sum",
        ),
        (["optim.scheduler=cosine"], r"optim.scheduler='cosine' is not one of constant, linear"),
        (["precision=fp16"], r"precision='fp16' is not one of fp32, bf16"),
        (["model.critic=none"], r"model.critic='none' is not one of shared, separate"),
        (["device=[1]"], r"bad value for config key 'device'"),
        (["schedule.timezone=Mars/Olympus"], r"schedule.timezone='Mars/Olympus' is not an IANA"),
        (
            ["promote.report=reports/eval/promotion.json"],
            r"eval.output_dir=.* and promote.report=.* overlap",
        ),
        (["train.log_every=1"], r"unknown config key 'train.log_every'"),
        (["optim.betas=${seed}"], r"optim.betas must be a list, got 0"),
        (["optim.betas=${data}"], r"optim.betas must be a list, got DataConfig"),
        (["seed"], r"override 'seed' is not of the form key=value"),
    ],
)
def test_bad_config_names_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides)


def test_unknown_key_in_file_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("ppo:\n  epoch: 2\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'ppo.epoch'.*bad.yaml"):
        load_config(path)


def test_missing_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("no/such/file.yaml")


def test_saved_config_loads_back(tmp_path):
    config = load_config(overrides=["ppo.epochs=2", "model.reference=ref"])
    save_config(config, tmp_path / "c.yaml")
    again = load_config(tmp_path / "c.yaml")
    assert to_yaml(again) == to_yaml(config)


def test_saved_config_is_written_atomically(tmp_path):
    save_config(load_config(), tmp_path / "c.yaml")
    save_config(load_config(overrides=["seed=3"]), tmp_path / "c.yaml")
    assert [p.name for p in tmp_path.iterdir()] == ["c.yaml"]
    assert load_config(tmp_path / "c.yaml").seed == 3


def _choice_fields(cls, prefix=""):
    """Dotted keys of the fields annotated ``Choice[...]``, through the nested sections."""
    for item in dataclasses.fields(cls):
        section = item.default_factory
        if section is not dataclasses.MISSING and dataclasses.is_dataclass(section):
            yield from _choice_fields(section, f"{prefix}{item.name}.")
        elif str(item.type).startswith("Choice["):
            yield f"{prefix}{item.name}"


def test_every_choice_field_is_checked_against_its_literal():
    assert sorted(_choice_fields(Config)) == sorted(CHOICES)
    # The math layer's own tuples are the same choices.
    assert get_args(CHOICES["kl.estimator"]) == KL_ESTIMATORS
    assert get_args(CHOICES["ppo.loss_agg_mode"]) == LOSS_AGG_MODES
    defaults = Config()
    for key, choices in CHOICES.items():
        value = defaults
        for part in key.split("."):
            value = getattr(value, part)
        assert value in get_args(choices), key


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_choices_with_dashes_load_from_overrides_and_files(mode, tmp_path):
    assert load_config(overrides=[f"ppo.loss_agg_mode={mode}"]).ppo.loss_agg_mode == mode
    path = tmp_path / "run.yaml"
    path.write_text(f"ppo:\n  loss_agg_mode: {mode}\nkl:\n  estimator: abs\n")
    config = load_config(path)
    assert (config.ppo.loss_agg_mode, config.kl.estimator) == (mode, "abs")
    assert isinstance(config.ppo.loss_agg_mode, str)


BATCH_SIZES = [
    ["ppo.rollout_batch_size=0"],
    ["ppo.mini_batch_size=-1"],
    ["ppo.micro_batch_size=32"],
    ["ppo.mini_batch_size=128"],
    ["ppo.micro_batch_size=6"],
    ["ppo.rollout_batch_size=60"],
]


@pytest.mark.parametrize("overrides", BATCH_SIZES)
def test_batch_size_errors_name_every_size_by_its_full_key(overrides):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    message = str(info.value)
    assert not re.search(
        r"(?<![\w.])(rollout_batch_size|mini_batch_size|micro_batch_size)", message
    )
    assert overrides[0].split("=")[0] in message, message


def test_a_section_given_a_value_in_a_file_names_the_section(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("seed: 1\nkl: [1, 2]\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == (
        f"bad value for config key 'kl' (in {path}): a section of keys, not a value "
        "(got [1, 2]); set the keys inside it, e.g. kl.estimator=k1"
    )


PARAMS = Path(__file__).resolve().parents[1] / "params.yaml"


def test_the_defaults_are_the_values_of_params_yaml():
    """`ppo <stage>` reads params.yaml when it is there and the defaults when it is not: the two
    must not differ, or a run's result would depend on the folder it started in."""
    params = flatten(OmegaConf.to_container(OmegaConf.load(PARAMS)))
    defaults = flatten(OmegaConf.structured(Config))
    assert set(params) <= set(defaults), set(params) - set(defaults)  # no unknown key
    differ = {
        key: (value, defaults[key]) for key, value in params.items() if value != defaults[key]
    }
    assert not differ, f"params.yaml vs the defaults in ppo_core/config.py: {differ}"


def test_every_key_is_documented():
    docs = field_docs()
    keys = flatten(Config())
    sections = {key.rsplit(".", 1)[0] for key in keys if "." in key}
    assert set(docs) == set(keys) | sections
    assert all(docs[key].strip() for key in docs), [key for key in docs if not docs[key].strip()]
    assert docs["ppo.epochs"] == "Passes over each rollout batch."
    assert docs["ppo"] == "The PPO update (Schulman et al. 2017) and its batching."
    assert docs["validation.min_tokens"].startswith("Shortest allowed prompt, in tokens")


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["model.policy='a # b: c'", "model.reference='0.5'", "schedule.cron='# * *'"],
        ["eval.baseline='multi\nline'", "optim.betas=[0.5,0.6]", "data.prompt_field=\"'x'\""],
    ],
)
def test_documented_yaml_loads_to_the_same_values(overrides):
    config = load_config(overrides=overrides)
    documented = to_yaml(config, docs=True)
    assert yaml.safe_load(documented) == yaml.safe_load(to_yaml(config))
    comments = [line for line in documented.splitlines() if line.lstrip().startswith("#")]
    assert len(comments) >= len(flatten(config))
    assert "# Local folder of the frozen KL reference; `null` uses a frozen copy of `policy`." in (
        documented
    )
