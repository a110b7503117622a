"""The project's typed configuration (layer 3).

One tree of OmegaConf structured dataclasses, loaded from YAML and overridden by ``key=value``
arguments. An unknown key, a wrong type or an out-of-range value fails at load time with the key's
name and value (:class:`ConfigError`). Every field is documented where it is defined. Builders in
the trainer unpack the config into keyword arguments: it never enters the math.
"""

from __future__ import annotations

import ast
import difflib
import functools
import inspect
import itertools
import math
import os
import re
import textwrap
import zoneinfo
from collections.abc import Iterable, Sequence
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, NoReturn, TypeVar, get_args

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ppo_core.files import atomic_write_text, first_line
from ppo_core.math.choices import (
    DEFAULT_KL_ESTIMATOR,
    AdvantageEstimator,
    KLEstimator,
    LossAggMode,
    ObjectiveCoefficients,
    check_batch_sizes,
    needs_critic,
    needs_groups,
)
from ppo_core.modeling.data import MAX_BYTES_PER_FILE, MAX_ROWS_PER_FILE

__all__ = [
    "CHOICES",
    "Config",
    "ConfigError",
    "field_docs",
    "load_config",
    "save_config",
    "to_yaml",
]


class ConfigError(ValueError):
    """A configuration problem; the message names the key, the value and what is allowed."""


# The longest string a config value may be, once its ${...} references are resolved. Paths and
# names are far shorter (a Linux path is at most 4096 bytes); the limit stops references that
# repeat a key from building strings of gigabytes (each doubling adds a key, not a gigabyte).
MAX_VALUE_CHARS = 4096
# A rejected value is shown at most this long in a message: it may hold a secret or megabytes,
# and messages reach logs.
SHOWN_CHARS = 40


# The string choices owned here; the loss aggregation modes and KL estimators are defined by the
# math functions that take them.
Device = Literal["auto", "cpu", "cuda"]
Precision = Literal["fp32", "bf16"]
Critic = Literal["shared", "separate", "none"]
OptimizerName = Literal["adamw", "sgd"]
SchedulerName = Literal["constant", "linear"]
StrategyName = Literal["ddp", "fsdp"]

# A field annotated ``Choice[SomeLiteral]`` is that Literal to a type checker and ``str`` to
# OmegaConf: OmegaConf 2.3 has no Literal fields (and matches an Enum by member name, which
# "token-mean" cannot be). validate_config checks the value against CHOICES.
if TYPE_CHECKING:
    _T = TypeVar("_T")
    Choice = Annotated[_T, "choice"]
else:

    class _ChoiceOfStr:
        def __getitem__(self, choices: Any) -> type:
            return str

    Choice = _ChoiceOfStr()

# Every key whose value is one of a fixed set of strings, with the Literal that lists them.
CHOICES: dict[str, Any] = {
    "device": Device,
    "precision": Precision,
    "model.critic": Critic,
    "model.reference_dtype": Precision,
    "base.dtype": Precision,
    "ppo.loss_agg_mode": LossAggMode,
    "ppo.advantage_estimator": AdvantageEstimator,
    "kl.estimator": KLEstimator,
    "optim.name": OptimizerName,
    "optim.scheduler": SchedulerName,
    "parallel.strategy": StrategyName,
}


@dataclass
class LoraConfig:
    """Low-rank adapters (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models")
    trained with ``peft`` in place of the policy's weights, which stay frozen. The KL reference
    is then the same weights with the adapter switched off: no second copy of the model."""

    enabled: bool = False
    """Train LoRA adapters (and the value head) instead of every weight of the policy."""
    rank: int = 8
    """Rank ``r`` of each adapter's update ``B A`` (``A``: ``r x in``, ``B``: ``out x r``)."""
    alpha: float = 16.0
    """Scale: the update is ``(alpha / rank) B A``."""
    dropout: float = 0.0
    """Dropout on each adapter's input during the update's passes (the rollout samples and
    scores without it); above 0 the update is random, so micro-batch sizes then agree only in
    expectation."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Names (or name suffixes) of the linear layers that get adapters, e.g. ``[q_proj,
    v_proj]``; ``all-linear`` is every linear layer of the trunk (the output layer excluded)."""
    adapter: str | None = None
    """A ``peft`` LoRA adapter folder of ``model.policy`` (e.g. from supervised fine-tuning) to
    start from; the KL reference is then a frozen copy of it, not the bare ``model.policy``."""
    merge: bool = False
    """Write the candidate as merged weights (a plain ``save_pretrained`` model) instead of the
    adapter plus the name and fingerprint of the ``model.policy`` it applies to."""


@dataclass
class ModelConfig:
    """Which models play which part."""

    policy: str = "models/base"
    """Local folder of a Hugging Face causal LM (``save_pretrained`` layout) to start from."""
    reference: str | None = None
    """Local folder of the frozen KL reference; ``None`` uses a frozen copy of ``policy``."""
    reward: str = "builtin:sentiment"
    """``builtin:sentiment`` (VADER), ``module:function`` (user code, called with lists of prompts
    and responses; it runs as Python), or a local folder of a sequence-classification reward
    model."""
    reward_timeout: float = 600.0
    """Seconds one call of the reward (one batch, in training or evaluation) may take before the
    run stops with an error naming the reward, so a hung reward cannot block scheduled runs; 0
    waits without limit."""
    critic: Choice[Critic] = "shared"
    """``shared``: a value head on the policy's trunk; ``separate``: a critic trunk of its own,
    initialised from the policy folder; ``none``: no value model at all, for the critic-free
    ``ppo.advantage_estimator`` choices (``grpo``, ``dr_grpo``, ``rloo``, ``reinforce_pp``)."""
    trust_remote_code: bool = False
    """Allow model folders to run their own Python code when loaded. Off unless you trust them."""
    reference_dtype: Choice[Precision] = "fp32"
    """Weights of the frozen KL reference loaded from a folder (``model.reference``, or a copy of
    ``model.policy`` without LoRA): ``bf16`` halves its memory at the cost of a rounded KL term
    (docs/training.md measures it)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters instead of full fine-tuning."""


@dataclass
class BaseConfig:
    """The ``base`` stage: where the starting policy (``model.policy``) comes from."""

    source: str | None = None
    """What to import as the base: a local Hugging Face causal-LM folder, a GGUF file
    (llama.cpp's format, dequantized), or a hub id (``org/name``) found in the local Hugging Face
    cache (never downloaded); ``None`` builds the tiny default (a 2-layer GPT-2 warm-started on
    generated movie reviews, no download)."""
    dtype: Choice[Precision] = "fp32"
    """Weights written by a GGUF import: ``fp32``, or ``bf16`` for half the disk and memory (a
    model folder is copied as it is and needs ``fp32`` here)."""
    tiny_steps: int = 400
    """Warm-start steps of the tiny default."""
    tiny_seed: int = 0
    """Seed of the tiny default's corpus, tokenizer and warm start."""


@dataclass
class DataConfig:
    """Prompt data: raw files in, a versioned train/eval split out.

    Files are JSONL (one JSON object with a ``prompt`` field a line) or Parquet."""

    raw_dir: str = "data/raw"
    """Folder of raw prompt files (``*.jsonl``, ``*.parquet``) read by ``ppo prepare``."""
    interim_dir: str = "data/interim"
    """Where ``ppo prepare`` writes the candidate version (``train.parquet``, ``eval.parquet``,
    ``manifest.json``) for ``ppo validate`` to check."""
    prepared_dir: str = "data/prepared"
    """The validated version, published by ``ppo validate`` only when every expectation holds, so
    a failed validation leaves the previous version in place."""
    eval_fraction: float = 0.15
    """Share of prompts held out for evaluation. The split hashes each prompt, so a prompt keeps
    its side when new raw data arrives."""
    split_seed: int = 0
    """Salt of the split hash."""
    train_file: str = "data/prepared/train.parquet"
    """Prompts the PPO loop samples from."""
    eval_file: str = "data/prepared/eval.parquet"
    """Held-out prompts for ``ppo evaluate``."""
    prompt_field: str = "prompt"
    """Name of the field that holds the prompt in each raw record."""
    max_rows_per_file: int = MAX_ROWS_PER_FILE
    """Most prompts one prompt file may hold (JSONL records, Parquet rows); a Parquet file is
    measured by its metadata before it is read, a JSONL file is read up to the first extra
    record. ``ppo prepare`` also refuses a split that would hold more."""
    max_bytes_per_file: int = MAX_BYTES_PER_FILE
    """Most bytes one prompt file may hold (1 GiB): a JSONL file's size; for Parquet, its data's
    uncompressed size in the metadata (all columns) and then the prompt column's text, measured
    before it is built (a compressed file of a few kB can hold gigabytes of repeated text)."""


@dataclass
class ValidationConfig:
    """Great Expectations checks run by ``ppo validate`` on the candidate data version."""

    min_tokens: int = 2
    """Shortest allowed prompt, in tokens of the policy's tokenizer (BOS included)."""
    max_tokens: int = 32
    """Longest allowed prompt; prompt plus ``generation.max_new_tokens`` must fit the model."""
    min_train_rows: int = 64
    """Smallest acceptable train split."""
    min_eval_rows: int = 16
    """Smallest acceptable eval split."""
    report_dir: str = "reports/validation"
    """Where the Data Docs HTML and ``summary.json`` go (written on failure too)."""


@dataclass
class PPOConfig:
    """The PPO update (Schulman et al. 2017) and its batching."""

    rollout_batch_size: int = 64
    """Responses sampled per iteration (per data-parallel rank): ``rollout_batch_size /
    samples_per_prompt`` drawn prompts, each sampled ``samples_per_prompt`` times."""
    mini_batch_size: int = 16
    """Rows per optimizer step; must divide ``rollout_batch_size`` (or set ``drop_last``)."""
    micro_batch_size: int = 16
    """Rows per forward/backward pass; must divide ``mini_batch_size``. Changes memory, not the
    gradient (exact accumulation)."""
    generation_batch_size: int | None = None
    """Rows sampled per ``generate`` call, each chunk with its own seed; ``None`` samples the whole
    per-rank batch at once. Rollouts depend only on the seed and the chunk, so runs on different
    numbers of ranks sample the same responses when this divides ``rollout_batch_size``."""
    scoring_batch_size: int | None = None
    """Rows per gradient-free forward pass in the rollout (old logprobs, values, reference
    logprobs); ``None`` uses ``micro_batch_size``. Larger is faster where memory allows; the
    numbers are the same."""
    epochs: int = 4
    """Passes over each rollout batch."""
    drop_last: bool = False
    """Drop rows that do not fill a last mini-batch (with a warning) instead of failing."""
    clip_eps: float = ObjectiveCoefficients.clip_eps
    """Policy ratio clip range, ``rho`` in ``[1 - clip_eps, 1 + clip_eps_high]``."""
    clip_eps_high: float | None = ObjectiveCoefficients.clip_eps_high
    """Upper clip range; ``None`` uses ``clip_eps``."""
    dual_clip: float | None = ObjectiveCoefficients.dual_clip
    """Dual-clip constant ``c > 1`` bounding the loss of negative advantages; ``None`` is off."""
    clip_eps_value: float | None = ObjectiveCoefficients.clip_eps_value
    """Value clip range around the rollout values; ``None`` is off."""
    vf_coef: float = ObjectiveCoefficients.vf_coef
    """Weight of the value loss."""
    entropy_coef: float = ObjectiveCoefficients.entropy_coef
    """Weight of the entropy bonus."""
    gamma: float = 1.0
    """Discount factor."""
    lam: float = 0.95
    """GAE lambda."""
    advantage_estimator: Choice[AdvantageEstimator] = "gae"
    """``gae`` (with a critic, ``model.critic`` shared or separate) or a critic-free one
    (``model.critic=none``): ``grpo`` (scores normalised within each prompt's samples),
    ``dr_grpo`` (the same without the division by their standard deviation), ``rloo``
    (leave-one-out baseline), ``reinforce_pp`` (returns normalised over the batch); see
    docs/training.md, "Advantage estimators"."""
    samples_per_prompt: int = 1
    """Responses sampled for each drawn prompt, in consecutive rows that stay on one rank; must
    divide ``rollout_batch_size`` (which counts responses). ``grpo``, ``dr_grpo`` and ``rloo``
    compare the samples of a prompt, so they need at least 2."""
    loss_agg_mode: Choice[LossAggMode] = ObjectiveCoefficients.loss_agg_mode
    """``token-mean``, ``seq-mean-token-mean`` or ``seq-mean-token-sum``."""
    whiten_advantages: bool = True
    """Whiten GAE advantages once per rollout batch (``reinforce_pp`` always normalises over the
    batch, ``grpo`` within groups, ``rloo`` not at all, as their papers do)."""
    target_kl: float | None = None
    """Stop the remaining updates of an iteration when a mini-batch's approximate KL exceeds it."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm; ``None`` is off."""
    missing_eos_penalty: float | None = None
    """Subtract this from the score of a response that did not end with EOS; ``None`` is off."""


@dataclass
class KLConfig:
    """The KL penalty against the reference model."""

    estimator: Choice[KLEstimator] = DEFAULT_KL_ESTIMATOR
    """``k1``, ``k2``, ``k3`` or ``abs``: the per-token estimate, in the reward or in the loss."""
    in_loss: bool = False
    """Add ``coef * KL`` to each token's loss, as GRPO does, instead of ``-coef * KL`` to its
    reward (the reward then is the score alone; ``k3`` is the usual estimator there)."""
    coef: float = 0.1
    """Initial (or fixed) coefficient ``beta``. 0.1 holds the tiny default near 2.5 nats per
    sequence; 0.05 lets it drift past 4 and 0.01 breaks grammar (docs/training.md)."""
    adaptive: bool = False
    """Adapt ``beta`` towards ``target`` (Ziegler et al. 2019)."""
    target: float = 6.0
    """Target KL per sequence, in nats, for the adaptive controller."""
    horizon: int = 10000
    """Horizon of the adaptive controller, in samples."""


@dataclass
class OptimConfig:
    """Optimizer and learning-rate schedule."""

    name: Choice[OptimizerName] = "adamw"
    """``adamw`` or ``sgd``."""
    lr: float = 1.5e-4
    """Learning rate (the peak one when a schedule warms up or decays)."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW) or L2 penalty (SGD)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon, added to the denominator for numerical stability."""
    momentum: float = 0.0
    """SGD momentum."""
    scheduler: Choice[SchedulerName] = "constant"
    """``constant`` or ``linear`` (decay to 0 over ``train.iterations``)."""
    warmup_iterations: int = 0
    """Iterations over which the learning rate rises linearly to ``lr``; 0 starts at ``lr``."""


@dataclass
class GenerationConfig:
    """Sampling for rollouts and evaluation. Set explicitly: a model's own generation config can
    silently add top-k 50, and the logprobs must describe the distribution that was sampled."""

    max_new_tokens: int = 16
    """Longest response, in tokens; a response that reaches it ends without EOS."""
    temperature: float = 1.0
    """Sampling temperature; 1.0 samples the policy's own distribution."""
    top_k: int = 0
    """0 disables top-k."""
    top_p: float = 1.0
    """1.0 disables nucleus sampling."""


@dataclass
class TrainConfig:
    """The training run."""

    iterations: int = 80
    """PPO iterations (rollout + update)."""
    output_dir: str = "models/candidate"
    """Where the final policy is saved (``save_pretrained`` layout plus the value head)."""
    checkpoint_dir: str = "checkpoints"
    """Where resumable checkpoints go."""
    checkpoint_every: int = 20
    """Write a checkpoint every N iterations (and always at the end)."""
    keep_checkpoints: int = 2
    """How many checkpoints to keep."""
    keep_set_aside: int = 2
    """How many runs' checkpoints to keep in ``checkpoint_dir/stale-*`` after a config or data
    change made training start over (oldest removed first); 0 removes them at once."""
    resume: bool = True
    """Resume from the newest checkpoint in ``checkpoint_dir`` when there is one."""
    allow_stale_data: bool = False
    """Train even when ``data.raw_dir`` no longer matches the prepared version's manifest (new,
    changed or removed raw files that ``ppo prepare`` and ``ppo validate`` have not taken in)."""
    metrics_dir: str = "reports/train"
    """DVCLive folder for the per-iteration metrics and plots (``curves.png`` too)."""
    gradient_checkpointing: bool = False
    """Keep only each transformer block's input during the update's forward passes and compute
    the rest again in the backward pass (non-reentrant activation checkpointing): less memory,
    about one more forward pass of time, the same gradients."""


@dataclass
class ParallelConfig:
    """How the models are spread over the ranks of a ``torchrun`` launch."""

    strategy: Choice[StrategyName] = "ddp"
    """``ddp``: every rank holds the whole policy, value head and reference
    (DistributedDataParallel); ``fsdp``: FSDP2 shards each transformer block and the rest over
    the ranks (the reference too), gathering the policy whole for sampling. The same update
    either way; ``fsdp`` needs 2 or more processes. With ``fsdp`` and ``precision=bf16`` the
    shards stay fp32 while the gathered parameters and the compute are bf16 and gradients are
    reduced in fp32 (FSDP2's ``MixedPrecisionPolicy``)."""
    reference_offload: bool = False
    """``fsdp`` only: keep the frozen reference's shards in CPU memory and copy each block to the
    device for its forward pass (FSDP2's ``CPUOffloadPolicy``): the reference then takes no
    device memory between its passes, for a host-to-device copy of it per scoring pass."""


@dataclass
class EvalConfig:
    """Held-out evaluation."""

    num_prompts: int = 64
    """Held-out prompts scored (the first ones of ``data.eval_file``)."""
    samples_per_prompt: int = 2
    """Responses sampled per prompt and model."""
    seed: int = 1234
    """Sampling seed; candidate and baseline use the same one."""
    output_dir: str = "reports/eval"
    """Where ``ppo evaluate`` writes ``metrics.json``, ``models.json``, ``samples.json`` and
    ``report.md``."""
    num_examples: int = 8
    """Sample generations written beside the metrics."""
    baseline: str | None = None
    """Model folder to compare against; ``None`` uses the current production version when the
    registry has one, else ``model.policy``."""
    reward: str | None = None
    """The reward that scores candidate and baseline (same forms as ``model.reward``); ``None``
    uses ``model.reward``, which must then be the one the candidate was trained with (recorded in
    its ``training_summary.json``): evaluation never runs a reward a model folder names."""


@dataclass
class PromoteConfig:
    """The gate between a trained candidate and production (``ppo promote``)."""

    min_improvement: float = 0.02
    """The candidate's held-out score must beat the baseline's (production, or the base model
    while there is no production yet) by at least this much."""
    max_kl: float = 4.0
    """Largest KL to the reference (nats per sequence) a promoted model may have."""
    min_eos_rate: float = 0.85
    """Smallest share of responses that end with EOS."""
    max_distinct_2_drop: float | None = 0.25
    """Guard against a reward bought with repetition: the candidate's distinct-2 (distinct word
    bigrams over all bigrams of its held-out responses) may fall below the baseline's by at most
    this much; ``None`` is off."""
    max_nll_increase: float | None = 1.0
    """Fluency guard: the reference model's negative log-likelihood of the candidate's responses
    (nats per response token, ``reference_nll``) may exceed the baseline's by at most this much;
    ``None`` is off. Text the reference finds unlikely (broken words, another language, token
    soup) raises it; fluent repetition does not, which ``max_distinct_2_drop`` guards."""
    check_reward: str | None = None
    """Guard against a reward that is gamed: a second scorer, independent of the training reward
    (same forms as ``model.reward``; ``builtin:afinn`` is the AFINN-165 lexicon), that
    ``ppo evaluate`` also runs on both models' responses (``check_score``); ``None`` is off."""
    max_check_drop: float = 0.1
    """The candidate's ``check_score`` may fall below the baseline's by at most this much."""
    production_dir: str = "models/production"
    """Promoted versions live here as ``v0001/``, ``v0002/``, ... (never overwritten)."""
    registry: str = "models/registry.json"
    """The model registry: every promotion decision, with lineage; names the current version."""
    report: str = "reports/promotion.json"
    """Where ``ppo promote`` writes its decision (the registry entry: reasons, lineage, metrics),
    promoted or not."""


@dataclass
class ScheduleConfig:
    """Scheduled retraining (the ``scheduled`` Prefect deployment)."""

    cron: str = "0 3 * * 1"
    """When to retrain: new raw data is picked up, training starts from the production model."""
    timezone: str = "UTC"
    """IANA time zone of ``cron`` (e.g. ``Europe/Berlin``); a zone with daylight saving time
    keeps the local hour across the change."""


@dataclass
class IngestConfig:
    """New prompt files arriving while the pipeline runs unattended (``ppo ingest FILE...``)."""

    inbox_dir: str = "data/inbox"
    """Where ``ppo ingest`` puts checked files; the next run of the Prefect flow moves them into
    ``data.raw_dir`` under the retraining lock before it prepares, so that a file arriving during
    a run never changes the data that run is training on."""
    rejected_dir: str = "data/rejected"
    """Where the flow sets aside the files a run took from the inbox when validation rejects the
    data they made (one folder a run, with the failed expectations), so that ``data.raw_dir`` is
    again what the production model was trained on and later files are not held up by them."""


@dataclass
class FlowConfig:
    """The Prefect flow ``retrain``: how long each stage may run before it is stopped (seconds;
    0 waits without limit). A stage over its limit is stopped with every process it started,
    is not retried, and fails the run with an error naming the key; the retraining lock is
    released, and a stopped ``train`` resumes from its last checkpoint on the next run."""

    prepare_timeout: float = 3600.0
    """Seconds ``prepare`` may run (reading and splitting the raw prompt files)."""
    base_timeout: float = 3600.0
    """Seconds ``base`` may run (building the tiny model, or copying ``base.source``)."""
    validate_timeout: float = 3600.0
    """Seconds ``validate`` may run (the data checks)."""
    train_timeout: float = 172800.0
    """Seconds ``train`` may run, each attempt (the flow retries a failed one twice)."""
    evaluate_timeout: float = 21600.0
    """Seconds ``evaluate`` may run."""
    promote_timeout: float = 3600.0
    """Seconds ``promote`` may run (copying the candidate into a production version)."""
    gpu_limit: str = "ppo-gpu"
    """Name of a Prefect global concurrency limit that ``train`` and ``evaluate`` each hold a
    slot of while they run, so that runs of several projects on one machine take turns on its
    accelerators (``prefect gcl create ppo-gpu --limit 1``); when no limit of that name exists
    the stages run without one."""


@dataclass
class Config:
    """The whole configuration."""

    seed: int = 0
    """Seed of the training run: value-head initialisation, prompt draws, sampling and
    mini-batch shuffles."""
    device: Choice[Device] = "auto"
    """``auto`` (CUDA when present), ``cpu`` or ``cuda``."""
    precision: Choice[Precision] = "fp32"
    """``fp32`` or ``bf16`` (autocast on CUDA)."""
    threads: int = 1
    """CPU threads for torch; 0 keeps torch's default. Tiny models run as fast on 1 thread, and a
    process that shares its cores with another slows down many times over with more."""
    model: ModelConfig = field(default_factory=ModelConfig)
    base: BaseConfig = field(default_factory=BaseConfig)
    data: DataConfig = field(default_factory=DataConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    promote: PromoteConfig = field(default_factory=PromoteConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    ingest: IngestConfig = field(default_factory=IngestConfig)
    flow: FlowConfig = field(default_factory=FlowConfig)


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Build the config: defaults, then the YAML file, then ``key=value`` overrides.

    Raises:
        ConfigError: unknown key, wrong type, malformed override, or a value out of range.
    """
    import yaml

    merged: DictConfig | ListConfig = OmegaConf.structured(Config)
    loaded: DictConfig | ListConfig | None = None
    try:
        if path is not None:
            path = Path(path)
            if not path.is_file():
                raise ConfigError(f"config file {str(path)!r} does not exist")
            try:
                loaded = OmegaConf.load(path)
            except (yaml.YAMLError, UnicodeDecodeError) as exc:
                raise ConfigError(
                    f"config file {str(path)!r} is not valid YAML: {first_line(exc)}"
                ) from None
            if not isinstance(loaded, DictConfig):
                raise ConfigError(
                    f"config file {str(path)!r} must hold a mapping of keys, "
                    f"not a {type(loaded).__name__}"
                )
            merged = OmegaConf.merge(merged, loaded)
    except OmegaConfBaseException as exc:
        raise ConfigError(_explain(exc, f" (in {path})", loaded)) from None
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {_shown_override(item)} is not of the form key=value")
        given: DictConfig | None = None
        _check_yaml_value(item)
        try:
            given = OmegaConf.from_dotlist([item])
            merged = OmegaConf.merge(merged, given)
        except yaml.YAMLError as exc:
            raise ConfigError(
                f"override {_shown_override(item)}: the value is not valid YAML ({first_line(exc)})"
            ) from None
        except OmegaConfBaseException as exc:
            raise ConfigError(
                _explain(exc, f" (override {_shown_override(item)})", given)
            ) from None
    # Before OmegaConf resolves anything: a resolver's value or a huge string must never exist.
    _check_references(merged)
    try:
        config: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        raise ConfigError(_explain(exc, "")) from None
    _check_shapes(config)
    validate_config(config)
    return config


def _check_yaml_value(item: str) -> None:
    """Refuse an override whose value YAML reads as a mapping with a key that is not a name, or
    as a list with an empty item.

    YAML reads a lone ``?`` as a mapping ``{None: None}``, ``{1: 2}`` as one keyed by a number
    and a lone ``-`` as the list ``[None]``; OmegaConf then reports an "incompatible key type" or
    an "invalid type assigned" against a key of its own choosing (``optim.betas[0]``). This
    names the override and the key the user wrote instead. A value that is not valid YAML is
    left to the merge, which says so.
    """
    import yaml

    key, _, value = item.partition("=")
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        return
    pending, why = [parsed], ""
    while pending and not why:
        node = pending.pop()
        if isinstance(node, dict):
            bad = [k for k in node if not isinstance(k, str)]
            if bad:
                why = (
                    "YAML reads a '?' there as a mapping with an empty key; put text in quotes"
                    if bad[0] is None
                    else f"a mapping's keys must be names, got {_short(bad[0])}"
                )
            pending.extend(node.values())
        elif isinstance(node, list):
            if any(value is None for value in node):
                why = (
                    "YAML reads it as a list with an empty item (a lone '-' is one); put text "
                    "in quotes"
                )
            pending.extend(node)
    if why:
        raise ConfigError(
            f"override {_shown_override(item)}: the value given to {_short(key)} is not a "
            f"config value: {why}"
        )


def _check_shapes(node: Any, prefix: str = "") -> None:
    """Every section is a section and every list a list; raise :class:`ConfigError` otherwise.

    OmegaConf types a ``${...}`` reference when it resolves it into a number or a string, not
    when it stands for a whole list or section (``optim.betas=${seed}``); this names the key.
    """
    for item in fields(node):
        key, value = f"{prefix}{item.name}", getattr(node, item.name)
        default = item.default if item.default_factory is MISSING else item.default_factory()
        shown = type(value).__name__ if is_dataclass(value) else _short(value)
        if is_dataclass(default):
            if type(value) is not type(default):
                raise ConfigError(f"{key} must be a section of keys, got {shown}")
            _check_shapes(value, f"{key}.")
        elif isinstance(default, list) and not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {shown}")


def _check_references(merged: DictConfig | ListConfig) -> None:
    """Refuse what a ``${...}`` may not do, before OmegaConf resolves anything.

    A config may refer to its own keys (``${model.policy}``, ``${.sibling}``, ``${..seed}``)
    and to nothing else: a resolver's value (``${oc.env:VAR}`` above all, or ``oc.decode``,
    ``oc.create``, ``oc.select``, ...) would be saved into ``ppo_config.yaml``, checkpoints,
    production versions and the registry, and echoed in messages. The length of each value
    holding a reference is added up from the lengths of what it refers to, without building it,
    so that references repeating a key (a string that doubles at every key) fail at once.
    Raises :class:`ConfigError` naming the key, with OmegaConf's words where it has them.
    """
    from omegaconf import grammar_parser
    from omegaconf.grammar.gen.OmegaConfGrammarParser import OmegaConfGrammarParser as Grammar

    tree: Any = OmegaConf.to_container(merged, resolve=False)
    lengths: dict[tuple[Any, ...], int] = {}
    measuring: list[tuple[Any, ...]] = []  # the values being measured, outermost first

    def fail(path: tuple[Any, ...], reason: str) -> NoReturn:
        key = ".".join(map(str, path))
        raise ConfigError(
            f"config key {_short(key)}: cannot resolve an ${{...}} reference: {reason}"
        )

    def value_at(path: tuple[Any, ...]) -> Any:
        node = tree
        for part in path:
            node = node[part]
        return node

    def target(path: tuple[Any, ...], reference: Any) -> tuple[Any, ...]:
        """Where an interpolation node (``${a.b}``, ``${..c}``, ``${a[0]}``) held at ``path``
        points: leading dots count up from the folder holding it."""
        dots, parts = 0, []
        for child in reference.getChildren():
            if isinstance(child, Grammar.ConfigKeyContext):
                parts.append(child.getText())
            elif child.getText() == "." and not parts:
                dots += 1
        where: tuple[Any, ...] = path[: len(path) - dots] if dots else ()
        node = value_at(where) if dots <= len(path) else None
        for part in parts:
            if isinstance(node, dict) and part in node:
                step: Any = part
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                step = int(part)
            elif isinstance(node, str) and "${" in node:
                fail(path, f"{reference.getText()} goes through another reference; name the key")
            else:
                fail(path, f"Interpolation key {_short('.'.join(parts))} not found")
            where, node = (*where, step), node[step]
        return where

    def measure(path: tuple[Any, ...]) -> int:
        """Characters of the value at ``path`` once resolved (a section or list as it prints)."""
        if path in lengths:
            return lengths[path]
        if path in measuring:
            fail(measuring[0], "Recursive interpolation detected")
        measuring.append(path)
        value = value_at(path)
        if isinstance(value, dict):
            total = 2 + sum(len(repr(key)) + 4 + measure((*path, key)) for key in value)
        elif isinstance(value, list):
            total = 2 + sum(2 + measure((*path, index)) for index in range(len(value)))
        elif isinstance(value, str) and "${" in value:
            try:
                parsed = grammar_parser.parse(value)
            except OmegaConfBaseException as exc:
                fail(path, _shorten_quoted(first_line(exc)))
            nodes = list(_parse_nodes(parsed))
            for node in nodes:
                if isinstance(node, Grammar.InterpolationResolverContext):
                    fail(
                        path,
                        f"the resolver {_short(node.resolverName().getText())} is not allowed: a "
                        "config may only refer to its own keys (${key}), as resolved values are "
                        "saved with the run and shown in messages",
                    )
            for node in nodes:
                if isinstance(node, Grammar.ConfigKeyContext) and node.interpolation():
                    fail(path, "a key built from another reference (${a.${b}}) is not allowed")
            total = 0
            for piece in parsed.text().getChildren():
                if isinstance(piece, Grammar.InterpolationContext):
                    total += measure(target(path, piece.interpolationNode()))
                else:  # text; an escape (\${) counts its backslash, an upper bound
                    total += len(piece.getText())
            if total > MAX_VALUE_CHARS:
                fail(
                    path,
                    f"it would give a string of {total} characters, over the limit of "
                    f"{MAX_VALUE_CHARS}",
                )
        else:
            total = len(str(value))
        measuring.pop()
        lengths[path] = total
        return total

    def leaves(node: Any, path: tuple[Any, ...]) -> Iterable[tuple[tuple[Any, ...], Any]]:
        if isinstance(node, dict):
            for key, value in node.items():
                yield from leaves(value, (*path, key))
        elif isinstance(node, list):
            for index, value in enumerate(node):
                yield from leaves(value, (*path, index))
        else:
            yield path, node

    for path, value in leaves(tree, ()):
        if isinstance(value, str) and "${" in value:
            measure(path)


def _parse_nodes(node: Any) -> Iterable[Any]:
    """``node`` and every node below it in an OmegaConf grammar parse tree, parents first."""
    yield node
    for child in node.getChildren() if hasattr(node, "getChildren") else ():
        yield from _parse_nodes(child)


def _explain(
    exc: OmegaConfBaseException, where: str, given: DictConfig | ListConfig | None = None
) -> str:
    """One line naming the key and, in ``where``, the file or override it came from.

    ``given`` is what that file or override holds: OmegaConf names no key when a whole section
    is given a plain value (``ppo=5``), so the key is found by comparing it with the schema.
    """
    key = getattr(exc, "full_key", None) or "?"
    first = _shorten_quoted(str(exc).splitlines()[0])
    if "Interpolation" in type(exc).__name__:
        return f"config key {_short(key)}{where}: cannot resolve an ${{...}} reference: {first}"
    if key == "?":
        found = _section_given_a_value(
            OmegaConf.to_container(given) if isinstance(given, DictConfig) else None
        )
        if found is None:
            return f"bad config{where}: {first}"
        key, value = found
        example = next(k for k in _all_keys() if k.startswith(f"{key}."))
        return (
            f"bad value for config key {key!r}{where}: a section of keys, not a value (got "
            f"{_short(value)}); set the keys inside it, e.g. "
            f"{example}={_as_override(_defaults()[example])}"
        )
    if "not in" in first or "Key" in type(exc).__name__:
        close = difflib.get_close_matches(key, _all_keys(), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        return (
            f"unknown config key {_short(key)}{where}: {first}.{hint} Run `ppo config` to list "
            "the keys."
        )
    return f"bad value for config key {_short(key)}{where}: {first}"


def _short(value: Any) -> str:
    """``repr(value)`` for a message, cut to about SHOWN_CHARS characters when longer."""
    if isinstance(value, str) and len(value) > SHOWN_CHARS:
        return f"{value[:SHOWN_CHARS]!r}... ({len(value)} characters)"
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS + 2 else f"{text[:SHOWN_CHARS]}..."


def _shown_override(item: str) -> str:
    """An override as a message quotes it: key and value each cut to SHOWN_CHARS characters."""
    key, sep, value = item.partition("=")
    shown = f"{key[:SHOWN_CHARS]}{sep}{value[:SHOWN_CHARS]}"
    return repr(item) if shown == item else f"{shown!r}... ({len(item)} characters)"


def _shorten_quoted(text: str, limit: int = 300) -> str:
    """``text`` (an OmegaConf message, which quotes values in full) with every quoted part over
    SHOWN_CHARS characters cut, and at most ``limit`` characters in all."""
    text = re.sub(
        rf"'([^']{{{SHOWN_CHARS + 1},}})'",
        lambda match: f"{match.group(1)[:SHOWN_CHARS]!r}... ({len(match.group(1))} characters)",
        text,
    )
    return text if len(text) <= limit else f"{text[:limit]}..."


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """A config (dataclass, DictConfig or YAML-loaded dict) as ``{"ppo.epochs": 4, ...}``."""
    if not isinstance(node, dict):
        node = OmegaConf.to_container(
            OmegaConf.structured(node) if not isinstance(node, DictConfig) else node
        )
    out: dict[str, Any] = {}
    for key, value in node.items():
        name = f"{prefix}{key}"
        out.update(flatten(value, f"{name}.") if isinstance(value, dict) else {name: value})
    return out


def _defaults() -> dict[str, Any]:
    return flatten(Config())


def _all_keys() -> list[str]:
    return list(_defaults())


def _as_override(value: Any) -> str:
    """``value`` as it is written after ``key=`` on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _section_given_a_value(
    given: Any, schema: Any = Config, prefix: str = ""
) -> tuple[str, Any] | None:
    """The first section of ``schema`` that ``given`` (a file's or an override's keys, as plain
    dicts) sets to a plain value or a list, with that value; ``None`` when there is none."""
    if not isinstance(given, dict):
        return None
    for item in fields(schema):
        section = item.default_factory
        if item.name not in given or section is MISSING or not is_dataclass(section):
            continue
        key, value = f"{prefix}{item.name}", given[item.name]
        if isinstance(value, dict):
            found = _section_given_a_value(value, section, f"{key}.")
            if found is not None:
                return found
        elif value is not None:
            return key, value
    return None


def _choice(key: str, value: Any, allowed: Iterable[str]) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ConfigError(f"{key}={_short(value)} is not one of {', '.join(allowed)}")


def _positive(key: str, value: float | int, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


_BATCH_ROWS = 1_000_000
_ITERATIONS = 100_000_000
_TOKENS = 1_000_000
_ROWS = 1_000_000_000
# Seeds: torch takes 64-bit ones; a larger integer (a flow run's `params`, a YAML file) would
# overflow in the middle of a run.
_SEED = 2**63 - 1
# Upper bounds of every integer key: sizes, counts and lengths far above any real run, so that
# only a slip (a few zeros too many) meets them, and it fails here, naming the key, instead of
# allocating for hours or running out of memory in the middle of a run; seeds within 64 bits.
UPPER_BOUNDS: dict[str, int] = {
    "seed": _SEED,
    "base.tiny_seed": _SEED,
    "data.split_seed": _SEED,
    "eval.seed": _SEED,
    "threads": 4096,
    "base.tiny_steps": 10_000_000,
    "model.lora.rank": 65_536,
    "data.max_rows_per_file": _ROWS,
    "data.max_bytes_per_file": 1 << 40,
    "validation.min_tokens": _TOKENS,
    "validation.max_tokens": _TOKENS,
    "validation.min_train_rows": _ROWS,
    "validation.min_eval_rows": _ROWS,
    "ppo.rollout_batch_size": _BATCH_ROWS,
    "ppo.mini_batch_size": _BATCH_ROWS,
    "ppo.micro_batch_size": _BATCH_ROWS,
    "ppo.generation_batch_size": _BATCH_ROWS,
    "ppo.scoring_batch_size": _BATCH_ROWS,
    "ppo.samples_per_prompt": _BATCH_ROWS,
    "ppo.epochs": 10_000,
    "kl.horizon": 10**12,
    "optim.warmup_iterations": _ITERATIONS,
    "generation.max_new_tokens": _TOKENS,
    "generation.top_k": 100_000_000,
    "train.iterations": _ITERATIONS,
    "train.checkpoint_every": _ITERATIONS,
    "train.keep_checkpoints": 10_000,
    "train.keep_set_aside": 10_000,
    "eval.num_prompts": 10_000_000,
    "eval.samples_per_prompt": 10_000,
    "eval.num_examples": 1_000_000,
}


# Folders and files a run writes or replaces, by config key.
WRITE_KEYS = (
    "data.interim_dir",
    "data.prepared_dir",
    "validation.report_dir",
    "train.output_dir",
    "train.checkpoint_dir",
    "train.metrics_dir",
    "eval.output_dir",
    "promote.production_dir",
    "promote.registry",
    "promote.report",
    "ingest.inbox_dir",
    "ingest.rejected_dir",
)
# Inputs no output may be, sit in or contain (model.policy is written by the base stage only).
READ_KEYS = (
    "model.policy",
    "model.reference",
    "model.lora.adapter",
    "base.source",
    "data.raw_dir",
    "data.train_file",
    "data.eval_file",
)


def check_write_paths(flat: dict[str, Any], write_keys: Sequence[str] = WRITE_KEYS) -> None:
    """Write targets stay where they are meant to be; raise :class:`ConfigError` otherwise.

    Every output (``write_keys``; the base stage adds ``model.policy``) counts where it really
    is, symbolic links resolved (:mod:`ppo_core.output_paths`). It must lie inside the project
    (the working folder), the system's temporary folder or a folder named in the environment
    variable ``PPO_ALLOWED_OUTPUT_ROOTS`` (several separated by ``:``), and may not be, sit in
    or contain ``.git``, ``.dvc``, ``.venv``, the source folders, ``data/raw`` or the files
    that define the pipeline; a relative path may not climb out of the working folder with
    ``..``. No two outputs may be the same or one inside the other, and none may be, sit
    inside or contain an input the run reads (``READ_KEYS``: the models, the raw data, the
    train and eval files) or the production folder, so that a run cannot replace its own
    inputs or a promoted version. ``flat`` is the config as ``flatten`` gives it.
    """
    from ppo_core.output_paths import OutputPathError, check_output, overlap, real_path

    # Inputs an output holds by design: the prepared version holds the train and eval files,
    # scheduled retraining imports a production version, the reference defaults to the policy.
    by_design = {
        ("base.source", "promote.production_dir"),
        ("data.train_file", "data.prepared_dir"),
        ("data.eval_file", "data.prepared_dir"),
        ("data.train_file", "data.interim_dir"),
        ("data.eval_file", "data.interim_dir"),
        ("model.reference", "model.policy"),
    }
    for key in write_keys:
        if not os.path.isabs(flat[key]) and os.path.normpath(flat[key]).split(os.sep)[0] == "..":
            raise ConfigError(
                f"{key}={str(flat[key])!r} leaves the working folder through '..'; "
                "keep outputs inside the project or give an absolute path"
            )
    try:
        writes = {key: check_output(key, flat[key]) for key in write_keys}
    except OutputPathError as exc:
        raise ConfigError(str(exc)) from None
    keys = list(writes)
    for i, first in enumerate(keys):
        for second in keys[i + 1 :]:
            if overlap(writes[first], writes[second]):
                raise ConfigError(
                    f"{first}={str(flat[first])!r} and {second}="
                    f"{str(flat[second])!r} overlap; each output needs a folder "
                    "of its own"
                )
    for read_key in READ_KEYS:
        value = flat.get(read_key)
        if value is None or ":" in str(value) or read_key in writes or "\0" in str(value):
            continue  # not a folder (builtin:..., module:function), an output, or no path at all
        read = real_path(value)
        for key, path in writes.items():
            if (read_key, key) not in by_design and overlap(path, read):
                raise ConfigError(
                    f"{key}={str(flat[key])!r} would write over {read_key}="
                    f"{value!r}; choose another folder"
                )


# check_batch_sizes names the sizes without their section; the config names them in full.
_PPO_KEY = re.compile(rf"(?<![\w.])({'|'.join(item.name for item in fields(PPOConfig))})\b")


def validate_config(config: Config) -> None:
    """Check ranges, choices and the nesting of batch sizes; raise :class:`ConfigError`."""
    flat = flatten(config)
    for key, value in flat.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {value}")
        if isinstance(value, str) and len(value) > MAX_VALUE_CHARS:
            raise ConfigError(
                f"{key} must be at most {MAX_VALUE_CHARS} characters long, got {len(value)}"
            )
        if isinstance(value, str) and "${" in value:
            # the text of an escaped \${...}: a saved config would hold it unescaped, and the
            # next load (a resumed run, `ppo evaluate`) would resolve it
            raise ConfigError(
                f"{key} must not hold '${{' (got {_short(value)}): a saved config would read "
                "it as a reference"
            )
    for key, bound in UPPER_BOUNDS.items():
        if flat[key] is not None and flat[key] > bound:
            raise ConfigError(f"{key} must be at most {bound}, got {flat[key]}")
    check_write_paths(flat)
    for key, choices in CHOICES.items():
        _choice(key, flat[key], get_args(choices))
    try:
        zoneinfo.ZoneInfo(config.schedule.timezone)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError):  # OSError: a name too long
        raise ConfigError(
            f"schedule.timezone={_short(config.schedule.timezone)} is not an IANA time "
            "zone name; use e.g. UTC or Europe/Berlin"
        ) from None
    ppo = config.ppo
    try:
        check_batch_sizes(
            ppo.rollout_batch_size,
            ppo.mini_batch_size,
            ppo.micro_batch_size,
            drop_last=ppo.drop_last,
        )
    except ValueError as exc:
        raise ConfigError(_PPO_KEY.sub(r"ppo.\1", str(exc))) from None
    for key, value in {
        "ppo.epochs": ppo.epochs,
        "ppo.clip_eps": ppo.clip_eps,
        "optim.lr": config.optim.lr,
        "generation.max_new_tokens": config.generation.max_new_tokens,
        "generation.temperature": config.generation.temperature,
        "train.iterations": config.train.iterations,
        "base.tiny_steps": config.base.tiny_steps,
        "validation.max_tokens": config.validation.max_tokens,
        "train.checkpoint_every": config.train.checkpoint_every,
        "train.keep_checkpoints": config.train.keep_checkpoints,
        "eval.num_prompts": config.eval.num_prompts,
        "eval.samples_per_prompt": config.eval.samples_per_prompt,
        "kl.target": config.kl.target,
        "kl.horizon": config.kl.horizon,
    }.items():
        _positive(key, value)
    for key, value in {
        "ppo.vf_coef": ppo.vf_coef,
        "ppo.entropy_coef": ppo.entropy_coef,
        "kl.coef": config.kl.coef,
        "optim.weight_decay": config.optim.weight_decay,
        "optim.warmup_iterations": config.optim.warmup_iterations,
        "generation.top_k": config.generation.top_k,
        "threads": config.threads,
        "eval.num_examples": config.eval.num_examples,
        "train.keep_set_aside": config.train.keep_set_aside,
        "validation.min_tokens": config.validation.min_tokens,
        "validation.min_train_rows": config.validation.min_train_rows,
        "validation.min_eval_rows": config.validation.min_eval_rows,
        "model.reward_timeout": config.model.reward_timeout,
        **{
            f"flow.{name}": value
            for name, value in vars(config.flow).items()
            if name.endswith("_timeout")
        },
    }.items():
        _positive(key, value, allow_zero=True)
    for key, value in {
        "ppo.clip_eps_high": ppo.clip_eps_high,
        "ppo.clip_eps_value": ppo.clip_eps_value,
        "ppo.target_kl": ppo.target_kl,
        "ppo.max_grad_norm": ppo.max_grad_norm,
    }.items():
        if value is not None:
            _positive(key, value)
    if ppo.generation_batch_size is not None and (
        ppo.generation_batch_size < 1 or ppo.rollout_batch_size % ppo.generation_batch_size
    ):
        raise ConfigError(
            f"ppo.generation_batch_size={ppo.generation_batch_size} must be a positive divisor of "
            f"ppo.rollout_batch_size={ppo.rollout_batch_size}"
        )
    if ppo.scoring_batch_size is not None and ppo.scoring_batch_size < 1:
        raise ConfigError(
            f"ppo.scoring_batch_size must be >= 1 (or null), got {ppo.scoring_batch_size}"
        )
    if ppo.dual_clip is not None and ppo.dual_clip <= 1.0:
        raise ConfigError(f"ppo.dual_clip must be > 1 (or null), got {ppo.dual_clip}")
    if not 0.0 <= ppo.gamma <= 1.0:
        raise ConfigError(f"ppo.gamma must be in [0, 1], got {ppo.gamma}")
    if not 0.0 <= ppo.lam <= 1.0:
        raise ConfigError(f"ppo.lam must be in [0, 1], got {ppo.lam}")
    if not 0.0 <= config.promote.min_eos_rate <= 1.0:
        raise ConfigError(
            f"promote.min_eos_rate must be in [0, 1], got {config.promote.min_eos_rate}"
        )
    _positive("promote.max_kl", config.promote.max_kl)
    for key, value in {
        "promote.max_distinct_2_drop": config.promote.max_distinct_2_drop,
        "promote.max_nll_increase": config.promote.max_nll_increase,
        "promote.max_check_drop": config.promote.max_check_drop,
    }.items():
        if value is not None:
            _positive(key, value, allow_zero=True)
    if not 0.0 < config.data.eval_fraction < 1.0:
        raise ConfigError(f"data.eval_fraction must be in (0, 1), got {config.data.eval_fraction}")
    if not 0.0 < config.generation.top_p <= 1.0:
        raise ConfigError(f"generation.top_p must be in (0, 1], got {config.generation.top_p}")
    if len(config.optim.betas) != 2 or not all(0.0 <= b < 1.0 for b in config.optim.betas):
        raise ConfigError(
            f"optim.betas must be two numbers in [0, 1), got {_short(config.optim.betas)}"
        )
    _check_lora(config.model)
    _check_estimator(config)
    if config.parallel.reference_offload and config.parallel.strategy != "fsdp":
        raise ConfigError(
            "parallel.reference_offload=true needs parallel.strategy=fsdp (got "
            f"{config.parallel.strategy!r}): only a sharded reference is offloaded"
        )


def _check_estimator(config: Config) -> None:
    """``ppo.advantage_estimator`` against ``model.critic`` and ``ppo.samples_per_prompt``: one
    error naming every key to change."""
    ppo, critic = config.ppo, config.model.critic
    estimator = ppo.advantage_estimator
    if ppo.samples_per_prompt < 1 or ppo.rollout_batch_size % ppo.samples_per_prompt:
        raise ConfigError(
            f"ppo.samples_per_prompt={ppo.samples_per_prompt} must be a positive divisor of "
            f"ppo.rollout_batch_size={ppo.rollout_batch_size} (which counts responses, "
            "each prompt's samples in consecutive rows)"
        )
    problems = []
    if needs_groups(estimator) and ppo.samples_per_prompt < 2:
        problems.append(
            "it compares the samples of each prompt and needs ppo.samples_per_prompt >= 2, got "
            f"ppo.samples_per_prompt={ppo.samples_per_prompt}"
        )
    if needs_critic(estimator) and critic == "none":
        problems.append(
            "it needs a critic, but model.critic=none; set model.critic=shared (or separate), "
            "or choose a critic-free estimator (grpo, dr_grpo, rloo, reinforce_pp)"
        )
    if not needs_critic(estimator) and critic != "none":
        problems.append(
            f"it uses no critic, but model.critic={critic} would build and train one; set "
            "model.critic=none"
        )
    if problems:
        raise ConfigError(f"ppo.advantage_estimator={estimator}: " + "; ".join(problems))


def _check_lora(model: ModelConfig) -> None:
    """The ``model.lora`` keys, and the modes LoRA does not combine with."""
    lora = model.lora
    if not lora.enabled:
        if lora.adapter is not None:
            raise ConfigError(
                f"model.lora.adapter={_short(lora.adapter)} needs model.lora.enabled=true"
            )
        return
    if lora.rank < 1:
        raise ConfigError(f"model.lora.rank must be >= 1, got {lora.rank}")
    _positive("model.lora.alpha", lora.alpha)
    if not 0.0 <= lora.dropout < 1.0:
        raise ConfigError(f"model.lora.dropout must be in [0, 1), got {lora.dropout}")
    if not lora.target_modules or not all(
        isinstance(name, str) and name.strip() for name in lora.target_modules
    ):
        raise ConfigError(
            "model.lora.target_modules must be a non-empty list of module names (or "
            f"[all-linear]), got {_short(lora.target_modules)}"
        )
    if model.critic == "separate":
        raise ConfigError(
            "model.critic=separate is not supported with model.lora.enabled=true: the value "
            "head shares the adapted trunk (model.critic=shared)"
        )
    if model.reference_dtype != "fp32" and model.reference is None:
        raise ConfigError(
            f"model.reference_dtype={model.reference_dtype} has no effect with LoRA and no "
            "model.reference: the reference is the policy's own weights with the adapter off"
        )


def to_yaml(config: Config, docs: bool = False) -> str:
    """The resolved config as YAML (saved beside every run's outputs).

    With ``docs``, each key's documentation (:func:`field_docs`) is a comment above it; the YAML
    loads to the same values.
    """
    if not docs:
        return OmegaConf.to_yaml(OmegaConf.structured(config))
    documented = field_docs()
    lines: list[str] = []

    def emit(node: dict[Any, Any], prefix: str, indent: str) -> None:
        for name, value in node.items():
            key = f"{prefix}{name}"
            if isinstance(value, dict) and not indent and lines:
                lines.append("")  # a blank line before each section
            lines.extend(_comment(documented.get(key, ""), indent))
            if isinstance(value, dict):
                lines.append(f"{indent}{name}:")
                emit(value, f"{key}.", indent + "  ")
            else:
                # one key at a time through the same dumper, so values keep their quoting
                text = OmegaConf.to_yaml(OmegaConf.create({name: value}))
                lines.extend(f"{indent}{line}" for line in text.splitlines())

    resolved = OmegaConf.to_container(OmegaConf.structured(config))
    assert isinstance(resolved, dict)
    emit(resolved, "", "")
    return "\n".join(lines) + "\n"


def _comment(doc: str, indent: str, width: int = 99) -> list[str]:
    """``doc`` as ``# `` lines that fit ``width`` columns, in Markdown's single backticks and
    with YAML's ``null`` for Python's ``None``."""
    text = " ".join(doc.replace("``", "`").replace("`None`", "`null`").split())
    return [f"{indent}# {line}" for line in textwrap.wrap(text, width - len(indent) - 2)]


@functools.cache
def _docs_by_key() -> dict[str, str]:
    source = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    classes = {node.name: node for node in source.body if isinstance(node, ast.ClassDef)}

    def documented(cls: type) -> dict[str, str]:
        """Field name to the string literal under it, in ``cls``'s body."""
        body = classes[cls.__name__].body
        return {
            node.target.id: inspect.cleandoc(after.value.value)
            for node, after in itertools.pairwise(body)
            if isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        }

    out: dict[str, str] = {}

    def walk(cls: type, prefix: str) -> None:
        docs = documented(cls)
        for item in fields(cls):
            key, section = f"{prefix}{item.name}", item.default_factory
            if section is not MISSING and isinstance(section, type) and is_dataclass(section):
                out[key] = docs.get(item.name) or inspect.cleandoc(section.__doc__ or "")
                walk(section, f"{key}.")
            else:
                out[key] = docs.get(item.name, "")

    walk(Config, "")
    return out


def field_docs() -> dict[str, str]:
    """The documentation of every key, by dotted key (``ppo.epochs``), and of every section
    (``ppo``, its class docstring).

    The text is the string literal written under each field in this module, so that the
    definition stays the one place a key is documented; an undocumented key maps to ``""``.
    """
    return dict(_docs_by_key())


def save_config(config: Config, path: str | Path) -> None:
    """Write the resolved config to ``path`` atomically."""
    atomic_write_text(path, to_yaml(config))
