import pytest

from ppo_core.config import Config, ConfigError, load_config, save_config, to_yaml


def test_defaults_load_and_nest():
    config = load_config()
    assert isinstance(config, Config)
    assert config.ppo.rollout_batch_size >= config.ppo.mini_batch_size >= config.ppo.micro_batch_size
    assert config.generation.top_k == 0 and config.generation.top_p == 1.0


def test_file_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("seed: 5\nppo:\n  epochs: 2\noptim:\n  lr: 0.001\n")
    config = load_config(path, ["ppo.epochs=3"])
    assert (config.seed, config.ppo.epochs, config.optim.lr) == (5, 3, 0.001)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["ppo.micro_bach_size=4"], r"unknown config key 'ppo.micro_bach_size'.*Did you mean 'ppo.micro_batch_size'"),
        (["optim.lr=fast"], r"bad value for config key 'optim.lr'.*'fast'"),
        (["seed=1.5"], r"config key 'seed'"),
        (["ppo.micro_batch_size=6"], r"micro_batch_size=6 does not divide mini_batch_size=16"),
        (["ppo.mini_batch_size=128"], r"mini_batch_size=128 is larger than rollout_batch_size=64"),
        (["kl.estimator=k7"], r"kl.estimator='k7' is not one of k1, k2, k3, abs"),
        (["optim.name=lion"], r"optim.name='lion' is not one of adamw, sgd"),
        (["ppo.loss_agg_mode=mean"], r"ppo.loss_agg_mode='mean'"),
        (["ppo.epochs=0"], r"ppo.epochs must be > 0, got 0"),
        (["ppo.lam=1.5"], r"ppo.lam must be in \[0, 1\], got 1.5"),
        (["generation.top_p=0"], r"generation.top_p must be in \(0, 1\]"),
        (["device=tpu"], r"device='tpu' is not one of auto, cpu, cuda"),
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
