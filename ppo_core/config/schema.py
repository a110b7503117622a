"""The configuration's schema (layer 3): one tree of OmegaConf structured dataclasses, its root
:class:`Config` and the sections of a training run (model, ppo, kl, optim, generation, train,
parallel); the stages' sections are in :mod:`.stage_sections`, the string choices in
:mod:`.choices`. Each field is documented by the string literal under it."""

from __future__ import annotations

from dataclasses import dataclass, field

from ppo_core.config.bounds import (
    MAX_BATCH_ROWS,
    MAX_ITERATIONS,
    MAX_SEED,
    MAX_TOKENS,
    MIN_TEMPERATURE,
    TEMPERATURE_FLOOR,
    bounded,
)
from ppo_core.config.choices import (
    Choice,
    Critic,
    Device,
    GenerationEngine,
    OldLogprobs,
    OptimizerName,
    Precision,
    RunPrecision,
    SchedulerName,
    StrategyName,
)
from ppo_core.config.stage_sections import (
    BaseConfig,
    DataConfig,
    EvalConfig,
    ExportConfig,
    FlowConfig,
    IngestConfig,
    PromoteConfig,
    RewardModelConfig,
    ScheduleConfig,
    ValidationConfig,
)
from ppo_core.math.declarations import (
    DEFAULT_KL_ESTIMATOR,
    AdvantageEstimator,
    KLEstimator,
    LossAggMode,
    ObjectiveCoefficients,
)


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
    reward_terms: list[str] = field(default_factory=list)
    """More rewards added to ``model.reward``'s score in training (same forms): a format
    check, a length penalty, as TRL's ``reward_funcs``. Each is logged as ``reward/<name>``;
    evaluation and the gate judge with ``model.reward`` alone."""
    reward_weights: list[float] = field(default_factory=list)
    """The weights of ``model.reward`` and then of each of ``model.reward_terms`` (TRL's
    ``reward_weights``); empty weighs each 1."""
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
    micro_batch_tokens: int | None = bounded(None, ge=1, most=MAX_TOKENS * MAX_BATCH_ROWS)
    """Padded tokens per forward/backward pass of the update: each of a mini-batch's
    micro-batches takes as many rows (in order of length) as fit in ``rows x (longest prompt +
    longest response)`` tokens, at least one, instead of ``micro_batch_size`` rows; so passes
    over short responses take more rows and long ones fewer, with memory bounded by the budget.
    ``None`` cuts by ``micro_batch_size``. Changes memory and speed, not the gradient (exact
    accumulation); the rollout's scoring passes keep ``scoring_batch_size``."""
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
    policy over the sampled responses; or ``sampling``, kept by the sampler as it draws each
    token, which saves that pass: the loop applies a shared value head as it samples, and a
    separate critic (``model.critic=separate``) or the vLLM engine leaves a pass that computes
    the values alone.
    The two differ by float rounding, the step-by-step cached forward against the whole-sequence
    one (measured: 2.1e-5 at most on SmolLM2-135M, 4.8e-6 on the tiny default; values 1.9e-6),
    and with LoRA the merged weights sampling runs on; docs/training.md, "Speed"."""
    tis_cap: float | None = bounded(None, ge=1)
    """Truncated importance sampling of the sampler's draws: each token's policy loss weighted
    by ``min(pi_old / pi_sampler, tis_cap)``, the trainer's rescored probability of the token
    over the sampler's (Yao et al. 2025; ``ppo_core/math/losses.py``), for when another
    implementation samples (``generation.engine=vllm``, bf16 weights). Needs
    ``ppo.old_logprobs=rescore``; ``None`` is off (every token weighs 1). The gap it corrects is
    logged as ``rollout/sampler_gap_*`` whatever this is."""
    sampler_gap_every: int = bounded(10, most=1_000_000)
    """With ``ppo.old_logprobs=sampling``, every this many iterations (the first included) the
    policy rescores ``ppo.sampler_gap_rows`` rows of the rollout, so that
    ``rollout/sampler_gap_*`` is logged in that mode too (with ``rescore`` every row of every
    iteration is compared, at no extra cost)."""
    sampler_gap_rows: int = bounded(8, most=MAX_BATCH_ROWS)
    """Rows per rank rescored for the sampler gap with ``ppo.old_logprobs=sampling``."""
    sampler_gap_warn: float | None = bounded(0.05, gt=0)
    """A ``rollout/sampler_gap_mean`` (nats per token) above this warns once per run, naming
    the likely causes: the sampler's log-probabilities are not the trainer's (fp32 on both sides
    agree to about 1e-5; bf16 against fp32 to about 1e-2). ``None``: never warn."""
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
    temperature: float = bounded(1.0, ge=MIN_TEMPERATURE, why=TEMPERATURE_FLOOR)
    """Sampling temperature; 1.0 samples the policy's own distribution. At least 1e-3: the
    distribution is already greedy there (measured on SmolLM2-135M: the most likely token drawn
    at every step, its log-probability exactly 0), so a lower one changes no draw and only
    multiplies log-probabilities and their gradients by 1/temperature; far lower (1e-37 for
    its largest logit, 35.5) logits / temperature overflow float32 and the probabilities turn
    to NaN."""
    top_k: int = bounded(0, ge=0, most=100_000_000)
    """0 disables top-k."""
    top_p: float = bounded(1.0, gt=0, le=1)
    """1.0 disables nucleus sampling."""
    few_row_layouts: bool = True
    """Multiply the sampling loop's few-row products (2 to 64 rows, layers at least 256 wide, on
    a CPU) in the layout measured fastest for each shape on this machine, ``(W @ x.T).T`` or
    ``F.linear``'s (``ppo_core/models/few_rows.py``; measured once per machine, about 3 s for
    SmolLM2's shapes, kept under ``~/.cache/ppo-core``). On a 2-core AMD EPYC (AVX2) the loop on
    SmolLM2 ran 1.17x to 1.31x as fast at 8 to 32 rows (docs/benchmarks.md). The layouts can
    differ by float rounding, which can change a draw that falls on a boundary; ``false`` keeps
    ``F.linear`` everywhere."""
    engine: Choice[GenerationEngine] = "loop"
    """What samples the rollouts and the evaluation's replies: ``loop``, the pipeline's own
    sampling loop (the exact reference, ``ppo_core/models/sampling.py``); or ``vllm``, a vLLM
    engine in a process and environment of its own (``make setup-vllm`` builds ``.venv-vllm``),
    started once per stage (one per rank with ``parallel.strategy=ddp``; refused with ``fsdp``,
    whose shards no engine can load) and given the policy's weights after every update
    (``ppo_core/experience/engines.py``; docs/design.md, "The vLLM engine")."""
    vllm_python: str = ".venv-vllm/bin/python"
    """The Python of the environment vLLM is installed in (``generation.engine=vllm``); a
    relative path is taken from the working directory."""
    vllm_kv_cache_gib: int = bounded(1, ge=1, most=1024)
    """On a CPU, the memory vLLM keeps for its KV cache, in GiB (``VLLM_CPU_KVCACHE_SPACE``)."""
    vllm_gpu_memory_utilization: float = bounded(0.3, gt=0, le=1)
    """On a GPU, the fraction of its memory vLLM may take (weights and KV cache); the trainer's
    models share the rest."""
    vllm_request_timeout: float = bounded(900.0, gt=0, le=86400)
    """Longest one request to the vLLM engine (a weight load, one chunk's sampling) may take,
    in seconds, before the stage stops with an error naming this key; a hung engine otherwise
    blocks training until the stage's own timeout."""


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
class Config:
    """The whole configuration."""

    seed: int = bounded(0, most=MAX_SEED)
    """Seed of the training run: value-head initialisation, prompt draws, sampling and
    mini-batch shuffles."""
    device: Choice[Device] = "auto"
    """``auto`` (CUDA when present), ``cpu`` or ``cuda``."""
    precision: Choice[RunPrecision] = "auto"
    """``auto``, ``fp32`` or ``bf16``: bf16 autocast around the forward passes of ``train``,
    ``evaluate`` and ``reward`` (fp32 weights and optimizer state). ``auto`` takes bf16 where it
    pays and fp32 elsewhere: a GPU with bf16, or a CPU whose measured bf16 matmul rate is at
    least 1.5x its fp32 one (bf16 instructions: AVX-512 BF16 or AMX; AVX2 CPUs emulate bf16 and
    get fp32), and only for models at least 256 wide (the tiny default stays fp32 everywhere).
    The choice and both rates are logged (``perf/bf16``, ``perf/matmul_*_gflops``)."""
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
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
