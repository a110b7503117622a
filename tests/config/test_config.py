import dataclasses
import itertools
import re
from pathlib import Path

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
from ppo_core.math.declarations import KL_ESTIMATORS, LOSS_AGG_MODES


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
        (["precision=fp16"], r"precision='fp16' is not one of auto, fp32, bf16"),
        (["model.critic=twin"], r"model.critic='twin' is not one of shared, separate, none"),
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
        (
            ["parallel.reference_offload=true"],
            r"^parallel.reference_offload=true needs parallel.strategy=fsdp \(got 'ddp'\)",
        ),
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
    assert CHOICES["kl.estimator"] == KL_ESTIMATORS
    assert CHOICES["ppo.loss_agg_mode"] == LOSS_AGG_MODES
    defaults = Config()
    for key, choices in CHOICES.items():
        value = defaults
        for part in key.split("."):
            value = getattr(value, part)
        assert value in choices, key


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


PARAMS = Path(__file__).resolve().parents[2] / "params.yaml"


def test_the_defaults_are_the_values_of_params_yaml():
    """`ppo <stage>` reads params.yaml when it is there and the defaults when it is not: the two
    must not differ, or a run's result would depend on the folder it started in."""
    params = flatten(OmegaConf.to_container(OmegaConf.load(PARAMS)))
    defaults = flatten(OmegaConf.structured(Config))
    assert set(params) <= set(defaults), set(params) - set(defaults)  # no unknown key
    # and every key is there, so `dvc exp run -S key=...` can set it and DVC tracks it
    assert set(defaults) <= set(params), set(defaults) - set(params)
    differ = {
        key: (value, defaults[key]) for key, value in params.items() if value != defaults[key]
    }
    assert not differ, f"params.yaml vs the defaults in ppo_core/config/schema.py: {differ}"


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


# ---- ${...}: plain references to other keys only, and never a string that grows without bound ----

SECRET = "s3cr3t-value-from-the-environment"


@pytest.mark.parametrize(
    ("override", "resolver"),
    [
        ("model.policy=${oc.env:PPO_TEST_SECRET}", "oc.env"),
        ("model.reward=builtin:${oc.env:PPO_TEST_SECRET}", "oc.env"),
        ("seed=${oc.env:PPO_TEST_SECRET,0}", "oc.env"),
        ("model.policy=${oc.decode:'x'}", "oc.decode"),
        ("model.policy='${oc.create:{a: 1}}'", "oc.create"),
        ("model.policy=${oc.select:data.raw_dir}", "oc.select"),
        ("model.policy=${oc.dict.keys:data}", "oc.dict.keys"),
        ("model.policy=${oc.dict.values:data}", "oc.dict.values"),
        ("model.policy=${oc.deprecated:data.raw_dir}", "oc.deprecated"),
        ("model.policy=${data.${oc.env:PPO_TEST_SECRET}}", "oc.env"),
    ],
)
def test_resolvers_are_refused_naming_the_key(override, resolver, monkeypatch):
    """A resolved value would be saved with the run (ppo_config.yaml, checkpoints, the registry)
    and echoed in messages; the environment in particular may hold secrets."""
    monkeypatch.setenv("PPO_TEST_SECRET", SECRET)
    key = override.split("=", 1)[0]
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    message = str(info.value)
    assert message.startswith(f"config key {key!r}: cannot resolve an ${{...}} reference: ")
    assert f"resolver {resolver!r}" in message and "\n" not in message
    assert SECRET not in message


def test_resolvers_in_a_file_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("PPO_TEST_SECRET", SECRET)
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  output_dir: out/${oc.env:PPO_TEST_SECRET}\n")
    with pytest.raises(ConfigError, match=r"^config key 'train.output_dir': .*'oc.env'") as info:
        load_config(path)
    assert SECRET not in str(info.value)


def test_a_literal_reference_is_refused_as_it_would_resolve_when_loaded_again(tmp_path):
    # "\${...}" resolves to the text "${...}", which a saved config would hold unescaped
    with pytest.raises(ConfigError, match=r"^model.policy must not hold '\$\{'"):
        load_config(overrides=[r"model.policy=models/\${oc.env:HOME}"])


def test_plain_references_still_resolve():
    config = load_config(
        overrides=[
            "model.reference=${model.policy}",
            "data.train_file=${data.prepared_dir}/train.parquet",
            "ppo.scoring_batch_size=${.micro_batch_size}",
            "eval.seed=${..seed}",
            "optim.lr=${optim.betas[1]}",
        ]
    )
    assert config.model.reference == config.model.policy == "models/base"
    assert config.data.train_file == "data/prepared/train.parquet"
    assert config.ppo.scoring_batch_size == 16 and config.eval.seed == 0
    assert config.optim.lr == 0.95


# String keys chained so that each holds its predecessor twice: the last would be 2**N times the
# first's length.
CHAIN = [
    "model.policy",
    "model.reward",
    "base.source",
    "data.raw_dir",
    "data.interim_dir",
    "data.prepared_dir",
    "data.train_file",
    "data.eval_file",
    "data.prompt_field",
    "validation.report_dir",
    "train.output_dir",
    "train.checkpoint_dir",
    "train.metrics_dir",
    "eval.output_dir",
    "eval.baseline",
    "eval.reward",
    "promote.production_dir",
    "promote.registry",
    "promote.report",
    "schedule.cron",
]


def doubling(links: int, width: int = 1) -> list[str]:
    """Overrides that set the first key of CHAIN to 10 characters and each of the next ``links``
    keys to a reference to the key before it followed by ``width`` times ``-`` and that
    reference again."""
    overrides = [f"{CHAIN[0]}=xxxxxxxxxx"]
    for before, after in itertools.pairwise(CHAIN[: links + 1]):
        reference = "${" + before + "}"
        overrides.append(f"{after}={reference}" + f"-{reference}" * width)
    return overrides


def test_references_that_build_a_long_string_are_refused_naming_the_key():
    # 10 characters, then 2 * n + 1 for each link: 21, 43, ..., 2815 after 8 links, 5631 after 9
    assert len(load_config(overrides=doubling(8)).data.prompt_field) == 2815
    with pytest.raises(ConfigError) as info:
        load_config(overrides=doubling(9))
    assert str(info.value) == (
        "config key 'validation.report_dir': cannot resolve an ${...} reference: it would give "
        "a string of 5631 characters, over the limit of 4096"
    )


def test_exponential_references_fail_before_anything_is_resolved():
    # 20 keys of 100 references each would be 10 * 100**19 characters: refused at once
    with pytest.raises(ConfigError, match=r"over the limit of 4096$"):
        load_config(overrides=doubling(len(CHAIN) - 1, width=100))


def test_a_reference_cycle_is_named():
    with pytest.raises(ConfigError, match=r"^config key 'model.policy': .*Recursive interpolation"):
        load_config(overrides=["model.policy=${model.reward}", "model.reward=a${model.policy}"])


def test_a_long_literal_value_is_refused():
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["data.raw_dir=" + "d" * 5000])
    assert str(info.value) == "data.raw_dir must be at most 4096 characters long, got 5000"


LONG = "z" * 10_000


@pytest.mark.parametrize(
    "overrides",
    [
        [f"kl.estimator={LONG}"],
        [f"seed={LONG}"],
        [f"ppo={LONG}"],
        [f"schedule.timezone={LONG[:3000]}"],
        [f"model.policy={LONG[:3000]}", "optim.betas=${model.policy}"],
        [f"model.policy={LONG[:3000]}", "seed=${model.policy}"],
        ["optim.betas=[" + ",".join(["0.5"] * 3000) + "]"],
        [LONG],
        [f"ppo.epochs={LONG}:"],
    ],
)
def test_rejected_values_are_shortened_in_messages(overrides):
    """A rejected value may hold a secret or megabytes, and messages reach logs."""
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    message = str(info.value)
    assert len(message) < 400 and "z" * 41 not in message and "0.5," * 41 not in message, message


# ---- upper bounds on sizes, counts and lengths -----------------------------------------------

BOUNDED = {
    "ppo.rollout_batch_size": 1_000_000,
    "generation.max_new_tokens": 1_000_000,
    "eval.num_prompts": 10_000_000,
    "eval.samples_per_prompt": 10_000,
    "validation.max_tokens": 1_000_000,
    "train.keep_checkpoints": 10_000,
    "train.iterations": 100_000_000,
    "ppo.epochs": 10_000,
    "data.max_rows_per_file": 1_000_000_000,
}


@pytest.mark.parametrize(("key", "bound"), BOUNDED.items())
def test_sizes_have_an_upper_bound_naming_the_key(key, bound):
    assert load_config(overrides=[f"{key}={bound}"])  # the bound itself is allowed
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[f"{key}={bound * 1000}"])
    assert str(info.value) == f"{key} must be at most {bound}, got {bound * 1000}"


def test_a_float_for_an_integer_key_is_refused():
    # YAML reads 1e9 as a float; OmegaConf does not turn it into an integer
    with pytest.raises(ConfigError, match=r"'ppo.rollout_batch_size'.*converted to Integer"):
        load_config(overrides=["ppo.rollout_batch_size=1e9"])


def test_every_integer_key_has_an_upper_bound_above_its_default():
    from ppo_core.config import UPPER_BOUNDS

    defaults = flatten(Config())
    integers = {
        key
        for key, value in defaults.items()
        if isinstance(value, int) and not isinstance(value, bool)
    } | {"ppo.generation_batch_size", "ppo.scoring_batch_size", "ppo.micro_batch_tokens"}
    assert set(UPPER_BOUNDS) == integers
    assert all(defaults[key] is None or defaults[key] <= UPPER_BOUNDS[key] for key in UPPER_BOUNDS)


@pytest.mark.parametrize("value", ["1e-40", "1e-30", "0.0009"])
def test_a_temperature_below_the_floor_is_refused_with_its_reason(value):
    """`generation.temperature=1e-40` passed "> 0 and finite", then logits / temperature
    overflowed float32 and every sampled token was the last of the vocabulary. The floor is
    1e-3, where sampling is greedy already; the refusal names the key, the floor and why."""
    with pytest.raises(ConfigError) as refused:
        load_config(overrides=[f"generation.temperature={value}"])
    message = str(refused.value)
    assert message.startswith(f"generation.temperature must be >= 0.001, got {float(value)}: ")
    assert "greedy already at 1e-3" in message and "NaN" in message, message
    assert load_config(overrides=["generation.temperature=0.001"]).generation.temperature == 1e-3


def test_every_range_declared_beside_a_field_is_enforced_at_its_edges():
    """Each field's bounds (``bounded(...)`` in schema.py) hold for its default, refuse a value
    just outside naming the key and the range, and take the edge itself when it is closed."""
    from ppo_core.config.checks import field_bounds

    defaults = flatten(Config())
    ranged = {
        key: b for key, b in field_bounds().items() if b.low is not None or b.high is not None
    }
    assert len(ranged) == 74  # 74 keys with a range, of 89 with a bound of any kind
    for key, bounds in ranged.items():
        assert defaults[key] is None or bounds.holds(defaults[key]), key
        edges = [(bounds.low, bounds.low_open, -0.5), (bounds.high, bounds.high_open, 0.5)]
        for edge, is_open, step in edges:
            if edge is None:
                continue
            outside = edge + step if isinstance(defaults[key], float) else int(edge + 2 * step)
            with pytest.raises(
                ConfigError, match=rf"^{re.escape(key)} must be {re.escape(bounds.rule())}"
            ):
                load_config(overrides=[f"{key}={outside}"])
            if is_open:
                with pytest.raises(ConfigError, match=rf"^{re.escape(key)} must be"):
                    load_config(overrides=[f"{key}={edge}"])
            else:
                load_config(overrides=[f"{key}={edge}"])


def test_the_objective_and_the_config_share_each_coefficient_and_default():
    import dataclasses

    from ppo_core.config import KLConfig, PPOConfig
    from ppo_core.math.declarations import ObjectiveCoefficients
    from ppo_core.math.objective import PPOObjective
    from ppo_core.training.update import objective_from

    names = [field.name for field in dataclasses.fields(ObjectiveCoefficients)]
    defaults = PPOObjective()
    assert {name: getattr(PPOConfig(), name) for name in names} == {
        name: getattr(defaults, name) for name in names
    }
    assert KLConfig().estimator == defaults.kl_estimator == "k1"
    # every coefficient set in the config reaches the objective
    config = load_config(
        overrides=[
            "ppo.clip_eps=0.11",
            "ppo.clip_eps_high=0.28",
            "ppo.dual_clip=3.0",
            "ppo.clip_eps_value=0.5",
            "ppo.vf_coef=0.7",
            "ppo.entropy_coef=0.01",
            "ppo.loss_agg_mode=seq-mean-token-sum",
            "kl.estimator=k3",
            "kl.in_loss=true",
        ]
    )
    objective = objective_from(config.ppo, config.kl, kl_coef=0.05)
    assert {name: getattr(objective, name) for name in names} == {
        name: getattr(config.ppo, name) for name in names
    }
    assert (objective.kl_coef, objective.kl_estimator) == (0.05, "k3")


def test_tis_needs_rescored_old_logprobs():
    """``ppo.tis_cap`` compares the trainer's rescoring with the sampler's log-probabilities;
    with ``ppo.old_logprobs=sampling`` they are one and the same, refused by both names."""
    load_config(overrides=["ppo.tis_cap=2"])
    with pytest.raises(ConfigError, match=r"ppo.tis_cap=2 .*ppo.old_logprobs='sampling'"):
        load_config(overrides=["ppo.tis_cap=2", "ppo.old_logprobs=sampling"])
    with pytest.raises(ConfigError, match=r"ppo.tis_cap must be >= 1"):
        load_config(overrides=["ppo.tis_cap=0.5"])
