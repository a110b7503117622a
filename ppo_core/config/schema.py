"""The configuration's schema (layer 3): one tree of OmegaConf structured dataclasses, each
field documented by the string literal under it, and the named choices of string keys."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar, get_args

from ppo_core.config.bounds import (
    MAX_BATCH_ROWS,
    MAX_ITERATIONS,
    MAX_ROWS,
    MAX_SEED,
    MAX_TOKENS,
    bounded,
)
from ppo_core.math.choices import (
    ADVANTAGE_ESTIMATORS,
    DEFAULT_KL_ESTIMATOR,
    AdvantageEstimator,
    KLEstimator,
    LossAggMode,
    ObjectiveCoefficients,
)
from ppo_core.prompts import MAX_BYTES_PER_FILE, MAX_ROWS_PER_FILE

# The string choices owned here; the loss aggregation modes and KL estimators are defined by the
# math functions that take them.
Device = Literal["auto", "cpu", "cuda"]
Precision = Literal["fp32", "bf16"]
Critic = Literal["shared", "separate", "none"]
OptimizerName = Literal["adamw", "sgd"]
SchedulerName = Literal["constant", "linear"]
StrategyName = Literal["ddp", "fsdp"]
ExportType = Literal["f32", "f16", "q8_0"]
OldLogprobs = Literal["rescore", "sampling"]

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


# Every key whose value is one of a fixed set of strings, with those strings (a Literal's, or the
# registry of advantage estimators).
CHOICES: dict[str, tuple[str, ...]] = {
    "device": get_args(Device),
    "precision": get_args(Precision),
    "model.critic": get_args(Critic),
    "model.reference_dtype": get_args(Precision),
    "base.dtype": get_args(Precision),
    "ppo.loss_agg_mode": get_args(LossAggMode),
    "ppo.advantage_estimator": ADVANTAGE_ESTIMATORS,
    "ppo.old_logprobs": get_args(OldLogprobs),
    "kl.estimator": get_args(KLEstimator),
    "optim.name": get_args(OptimizerName),
    "optim.scheduler": get_args(SchedulerName),
    "parallel.strategy": get_args(StrategyName),
    "export.type": get_args(ExportType),
}


@dataclass
class LoraConfig:
    """Low-rank adapters (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models")
    trained with ``peft`` in place of the policy's weights, which stay frozen. The KL reference
    is then the same weights with the adapter switched off: no second copy of the model."""

    enabled: bool = False
    """Train LoRA adapters (and the value head) instead of every weight of the policy."""
    rank: int = bounded(8, most=65_536)
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
    reward_timeout: float = bounded(600.0, ge=0)
    """Seconds one call of the reward (one batch, in training or evaluation) may take before the
    run stops with an error naming the reward, so a hung reward cannot block scheduled runs; 0
    waits without limit."""
    critic: Choice[Critic] = "shared"
    """``shared``: a value head on the policy's trunk; ``separate``: a critic trunk of its own,
    initialised from the policy folder; ``none``: no value model at all, for a critic-free
    ``ppo.advantage_estimator``."""
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
    tiny_steps: int = bounded(400, gt=0, most=10_000_000)
    """Warm-start steps of the tiny default."""
    tiny_seed: int = bounded(0, most=MAX_SEED)
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
    eval_fraction: float = bounded(0.15, gt=0, lt=1)
    """Share of prompts held out for evaluation. The split hashes each prompt, so a prompt keeps
    its side when new raw data arrives."""
    split_seed: int = bounded(0, most=MAX_SEED)
    """Salt of the split hash."""
    train_file: str = "data/prepared/train.parquet"
    """Prompts the PPO loop samples from."""
    eval_file: str = "data/prepared/eval.parquet"
    """Held-out prompts for ``ppo evaluate``."""
    prompt_field: str = "prompt"
    """Name of the field that holds the prompt in each raw record."""
    max_rows_per_file: int = bounded(MAX_ROWS_PER_FILE, most=MAX_ROWS)
    """Most prompts one prompt file may hold (JSONL records, Parquet rows); a Parquet file is
    measured by its metadata before it is read, a JSONL file is read up to the first extra
    record. ``ppo prepare`` also refuses a split that would hold more."""
    max_bytes_per_file: int = bounded(MAX_BYTES_PER_FILE, most=1 << 40)
    """Most bytes one prompt file may hold (1 GiB): a JSONL file's size; for Parquet, its data's
    uncompressed size in the metadata (all columns) and then the prompt column's text, measured
    before it is built (a compressed file of a few kB can hold gigabytes of repeated text)."""


@dataclass
class ValidationConfig:
    """Great Expectations checks run by ``ppo validate`` on the candidate data version."""

    min_tokens: int = bounded(2, ge=0, most=MAX_TOKENS)
    """Shortest allowed prompt, in tokens of the policy's tokenizer (BOS included)."""
    max_tokens: int = bounded(32, gt=0, most=MAX_TOKENS)
    """Longest allowed prompt; prompt plus ``generation.max_new_tokens`` must fit the model."""
    min_train_rows: int = bounded(64, ge=0, most=MAX_ROWS)
    """Smallest acceptable train split."""
    min_eval_rows: int = bounded(16, ge=0, most=MAX_ROWS)
    """Smallest acceptable eval split."""
    report_dir: str = "reports/validation"
    """Where the Data Docs HTML and ``summary.json`` go (written on failure too)."""


@dataclass
class PPOConfig:
    """The PPO update (Schulman et al. 2017) and its batching."""

    rollout_batch_size: int = bounded(64, most=MAX_BATCH_ROWS)
    """Responses sampled per iteration (per data-parallel rank): ``rollout_batch_size /
    samples_per_prompt`` drawn prompts, each sampled ``samples_per_prompt`` times."""
    mini_batch_size: int = bounded(16, most=MAX_BATCH_ROWS)
    """Rows per optimizer step; must divide ``rollout_batch_size`` (or set ``drop_last``)."""
    micro_batch_size: int = bounded(16, most=MAX_BATCH_ROWS)
    """Rows per forward/backward pass; must divide ``mini_batch_size``. Changes memory, not the
    gradient (exact accumulation)."""
    generation_batch_size: int | None = bounded(None, most=MAX_BATCH_ROWS)
    """Rows sampled per ``generate`` call, each chunk with its own seed; ``None`` samples the whole
    per-rank batch at once. Rollouts depend only on the seed and the chunk, so runs on different
    numbers of ranks sample the same responses when this divides ``rollout_batch_size``."""
    scoring_batch_size: int | None = bounded(None, ge=1, most=MAX_BATCH_ROWS)
    """Rows per gradient-free forward pass in the rollout (old logprobs, values, reference
    logprobs); ``None`` uses ``micro_batch_size``. Larger is faster where memory allows; the
    numbers agree to float rounding (rows are scored in chunks cut to their own lengths:
    measured 2.4e-6 in a logprob on the tiny default)."""
    old_logprobs: Choice[OldLogprobs] = "rescore"
    """Where the rollout's old log-probabilities come from: ``rescore``, a forward pass of the
    policy over the sampled responses; or ``sampling``, kept by the sampling loop as it draws
    each token, which saves that pass when there is no critic (a critic's values still need it).
    The two differ by float rounding, the step-by-step cached forward against the whole-sequence
    one (measured: 2.1e-5 at most on SmolLM2-135M, 4.8e-6 on the tiny default), and with LoRA
    the merged weights sampling runs on; docs/training.md, "Speed"."""
    epochs: int = bounded(4, gt=0, most=10_000)
    """Passes over each rollout batch."""
    drop_last: bool = False
    """Drop rows that do not fill a last mini-batch (with a warning) instead of failing."""
    clip_eps: float = bounded(ObjectiveCoefficients.clip_eps, gt=0)
    """Policy ratio clip range, ``rho`` in ``[1 - clip_eps, 1 + clip_eps_high]``."""
    clip_eps_high: float | None = bounded(ObjectiveCoefficients.clip_eps_high, gt=0)
    """Upper clip range; ``None`` uses ``clip_eps``."""
    dual_clip: float | None = bounded(ObjectiveCoefficients.dual_clip, gt=1)
    """Dual-clip constant ``c > 1`` bounding the loss of negative advantages; ``None`` is off."""
    clip_eps_value: float | None = bounded(ObjectiveCoefficients.clip_eps_value, gt=0)
    """Value clip range around the rollout values; ``None`` is off."""
    vf_coef: float = bounded(ObjectiveCoefficients.vf_coef, ge=0)
    """Weight of the value loss."""
    entropy_coef: float = bounded(ObjectiveCoefficients.entropy_coef, ge=0)
    """Weight of the entropy bonus."""
    gamma: float = bounded(1.0, ge=0, le=1)
    """Discount factor."""
    lam: float = bounded(0.95, ge=0, le=1)
    """GAE lambda."""
    advantage_estimator: Choice[AdvantageEstimator] = "gae"
    """``gae`` (with a critic, ``model.critic`` shared or separate) or a critic-free one
    (``model.critic=none``): ``grpo`` (scores normalised within each prompt's samples),
    ``dr_grpo`` (the same without the division by their standard deviation), ``rloo``
    (leave-one-out baseline), ``reinforce_pp`` (returns normalised over the batch); see
    docs/training.md, "Advantage estimators"."""
    samples_per_prompt: int = bounded(1, most=MAX_BATCH_ROWS)
    """Responses sampled for each drawn prompt, in consecutive rows that stay on one rank; must
    divide ``rollout_batch_size`` (which counts responses). ``grpo``, ``dr_grpo`` and ``rloo``
    compare the samples of a prompt, so they need at least 2."""
    loss_agg_mode: Choice[LossAggMode] = ObjectiveCoefficients.loss_agg_mode
    """``token-mean``, ``seq-mean-token-mean`` or ``seq-mean-token-sum``."""
    whiten_advantages: bool = True
    """Whiten GAE advantages once per rollout batch (``reinforce_pp`` always normalises over the
    batch, ``grpo`` within groups, ``rloo`` not at all, as their papers do)."""
    target_kl: float | None = bounded(None, gt=0)
    """Stop the remaining updates of an iteration when a mini-batch's approximate KL exceeds it."""
    max_grad_norm: float | None = bounded(1.0, gt=0)
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
    coef: float = bounded(0.1, ge=0)
    """Initial (or fixed) coefficient ``beta``. 0.1 holds the tiny default near 2.5 nats per
    sequence; 0.05 lets it drift past 4 and 0.01 breaks grammar (docs/training.md)."""
    adaptive: bool = False
    """Adapt ``beta`` towards ``target`` (Ziegler et al. 2019)."""
    target: float = bounded(6.0, gt=0)
    """Target KL per sequence, in nats, for the adaptive controller."""
    horizon: int = bounded(10000, gt=0, most=10**12)
    """Horizon of the adaptive controller, in samples."""


@dataclass
class OptimConfig:
    """Optimizer and learning-rate schedule."""

    name: Choice[OptimizerName] = "adamw"
    """``adamw`` or ``sgd``."""
    lr: float = bounded(1.5e-4, gt=0)
    """Learning rate (the peak one when a schedule warms up or decays)."""
    weight_decay: float = bounded(0.0, ge=0)
    """Decoupled weight decay (AdamW) or L2 penalty (SGD)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon, added to the denominator for numerical stability."""
    momentum: float = 0.0
    """SGD momentum."""
    scheduler: Choice[SchedulerName] = "constant"
    """``constant`` or ``linear`` (decay to 0 over ``train.iterations``)."""
    warmup_iterations: int = bounded(0, ge=0, most=MAX_ITERATIONS)
    """Iterations over which the learning rate rises linearly to ``lr``; 0 starts at ``lr``."""


@dataclass
class GenerationConfig:
    """Sampling for rollouts and evaluation. Set explicitly: a model's own generation config can
    silently add top-k 50, and the logprobs must describe the distribution that was sampled."""

    max_new_tokens: int = bounded(16, gt=0, most=MAX_TOKENS)
    """Longest response, in tokens; a response that reaches it ends without EOS."""
    temperature: float = bounded(1.0, gt=0)
    """Sampling temperature; 1.0 samples the policy's own distribution."""
    top_k: int = bounded(0, ge=0, most=100_000_000)
    """0 disables top-k."""
    top_p: float = bounded(1.0, gt=0, le=1)
    """1.0 disables nucleus sampling."""


@dataclass
class TrainConfig:
    """The training run."""

    iterations: int = bounded(80, gt=0, most=MAX_ITERATIONS)
    """PPO iterations (rollout + update)."""
    output_dir: str = "models/candidate"
    """Where the final policy is saved (``save_pretrained`` layout plus the value head)."""
    checkpoint_dir: str = "checkpoints"
    """Where resumable checkpoints go."""
    checkpoint_every: int = bounded(20, gt=0, most=MAX_ITERATIONS)
    """Write a checkpoint every N iterations (and always at the end)."""
    keep_checkpoints: int = bounded(2, gt=0, most=10_000)
    """How many checkpoints to keep."""
    keep_set_aside: int = bounded(2, ge=0, most=10_000)
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

    num_prompts: int = bounded(64, gt=0, most=10_000_000)
    """Held-out prompts scored (the first ones of ``data.eval_file``)."""
    samples_per_prompt: int = bounded(2, gt=0, most=10_000)
    """Responses sampled per prompt and model."""
    seed: int = bounded(1234, most=MAX_SEED)
    """Sampling seed; candidate and baseline use the same one."""
    output_dir: str = "reports/eval"
    """Where ``ppo evaluate`` writes ``metrics.json``, ``models.json``, ``samples.json`` and
    ``report.md``."""
    num_examples: int = bounded(8, ge=0, most=1_000_000)
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
    max_kl: float = bounded(4.0, gt=0)
    """Largest KL to the reference (nats per sequence) a promoted model may have."""
    max_kl_from_origin: float | None = bounded(12.0, gt=0)
    """Largest KL (nats per sequence) a promoted model may have to the first model of its chain
    of generations (the origin: the base the first production version trained from). Each
    generation's ``max_kl`` is against its own baseline, so a chain can drift ``max_kl`` per
    generation; this bounds the sum (default: three generations at the full budget). ``None``
    is off."""
    min_eos_rate: float = bounded(0.85, ge=0, le=1)
    """Smallest share of held-out responses that end with EOS; the others were cut at
    ``generation.max_new_tokens``. An absolute floor: a candidate below it is refused even when
    its baseline is lower still (the reason shows both)."""
    max_distinct_2_drop: float | None = bounded(0.25, ge=0)
    """Guard against a reward bought with repetition: the candidate's distinct-2 (distinct word
    bigrams over all bigrams of its held-out responses) may fall below the baseline's by at most
    this much; ``None`` is off."""
    max_nll_increase: float | None = bounded(1.0, ge=0)
    """Fluency guard: the reference model's negative log-likelihood of the candidate's responses
    (nats per response token, ``reference_nll``) may exceed the baseline's by at most this much;
    ``None`` is off. Text the reference finds unlikely (broken words, another language, token
    soup) raises it; fluent repetition does not, which ``max_distinct_2_drop`` guards."""
    check_reward: str | None = None
    """Guard against a reward that is gamed: a second scorer, independent of the training reward
    (same forms as ``model.reward``; ``builtin:afinn`` is the AFINN-165 lexicon), that
    ``ppo evaluate`` also runs on both models' responses (``check_score``); ``None`` is off."""
    max_check_drop: float = bounded(0.1, ge=0)
    """The candidate's ``check_score`` may fall below the baseline's by at most this much."""
    production_dir: str = "models/production"
    """Promoted versions live here as ``v0001/``, ``v0002/``, ... (never overwritten)."""
    registry: str = "models/registry.json"
    """The model registry: every promotion decision, with lineage; names the current version."""
    report: str = "reports/promotion.json"
    """Where ``ppo promote`` writes its decision (the registry entry: reasons, lineage, metrics),
    promoted or not."""


@dataclass
class ExportConfig:
    """``ppo export``: a production version as one GGUF file, the format llama.cpp, Ollama and
    LM Studio serve (run on demand: ``dvc repro serving/dvc.yaml``)."""

    version: str | None = None
    """The production version to export (``v0003``); ``None`` exports the current one."""
    type: Choice[ExportType] = "f16"
    """Tensor type of the weights: ``f32`` (exact), ``f16`` (half the size; the same greedy
    tokens in the tests) or ``q8_0`` (8-bit blocks, a quarter of ``f32``; llama.cpp's
    near-lossless quantisation). Norms and biases stay F32."""
    dir: str = "exports"
    """Where ``<version>-<type>.gguf`` and its record ``<version>-<type>.json`` are written;
    an existing file is never replaced."""


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

    prepare_timeout: float = bounded(3600.0, ge=0)
    """Seconds ``prepare`` may run (reading and splitting the raw prompt files)."""
    base_timeout: float = bounded(3600.0, ge=0)
    """Seconds ``base`` may run (building the tiny model, or copying ``base.source``)."""
    validate_timeout: float = bounded(3600.0, ge=0)
    """Seconds ``validate`` may run (the data checks)."""
    train_timeout: float = bounded(172800.0, ge=0)
    """Seconds ``train`` may run, each attempt (the flow retries a failed one twice)."""
    evaluate_timeout: float = bounded(21600.0, ge=0)
    """Seconds ``evaluate`` may run."""
    promote_timeout: float = bounded(3600.0, ge=0)
    """Seconds ``promote`` may run (copying the candidate into a production version)."""
    gpu_limit: str = "ppo-gpu"
    """Name of a Prefect global concurrency limit that ``train`` and ``evaluate`` each hold a
    slot of while they run, so that runs of several projects on one machine take turns on its
    accelerators (``prefect gcl create ppo-gpu --limit 1``); when no limit of that name exists
    the stages run without one."""


@dataclass
class Config:
    """The whole configuration."""

    seed: int = bounded(0, most=MAX_SEED)
    """Seed of the training run: value-head initialisation, prompt draws, sampling and
    mini-batch shuffles."""
    device: Choice[Device] = "auto"
    """``auto`` (CUDA when present), ``cpu`` or ``cuda``."""
    precision: Choice[Precision] = "fp32"
    """``fp32`` or ``bf16`` (autocast on CUDA)."""
    threads: int = bounded(1, ge=0, most=4096)
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
    export: ExportConfig = field(default_factory=ExportConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    ingest: IngestConfig = field(default_factory=IngestConfig)
    flow: FlowConfig = field(default_factory=FlowConfig)
