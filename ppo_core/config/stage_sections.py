"""The sections of the configuration for the stages around training: where the base comes
from (``base``), the data and its validation (``data``, ``validation``), the evaluation and the
promotion gate (``eval``, ``promote``), the export (``export``) and the scheduled runs
(``schedule``, ``ingest``, ``flow``). Each field is documented by the string literal under it."""

from __future__ import annotations

from dataclasses import dataclass, field

from ppo_core.config.bounds import MAX_ROWS, MAX_SEED, MAX_TOKENS, bounded
from ppo_core.config.choices import Choice, ExportType, Precision
from ppo_core.prompts import MAX_BYTES_PER_FILE, MAX_ROWS_PER_FILE


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
    reference_fields: list[str] = field(default_factory=list)
    """Fields each prompt row carries beside its prompt for the reward to check replies
    against (``answer``, ``tests``: any JSON value in JSONL, text in a Parquet column). Kept
    with their prompt through ``prepare``'s split, checked by ``validate`` (present, at most
    1 MiB each), and given to a reward that names them as keyword arguments
    (``def reward(prompts, responses, *, answer)``, ``builtin:math_answer``)."""
    max_rows_per_file: int = bounded(MAX_ROWS_PER_FILE, most=MAX_ROWS)
    """Most prompts one prompt file may hold (JSONL records, Parquet rows); a Parquet file is
    measured by its metadata before it is read, a JSONL file is read up to the first extra
    record. ``ppo prepare`` also refuses a split that would hold more."""
    max_bytes_per_file: int = bounded(MAX_BYTES_PER_FILE, most=1 << 40)
    """Most bytes one prompt file may hold (1 GiB): a JSONL file's size; for Parquet, its data's
    uncompressed size in the metadata (all columns) and then the prompt column's text, measured
    before it is built (a compressed file of a few kB can hold gigabytes of repeated text)."""
    feedback_dir: str = "data/feedback"
    """Folder of preference feedback files (``*.jsonl``, ``*.parquet``): pairs (``prompt`` or
    ``messages``, ``chosen``, ``rejected``) or ratings (``prompt``, ``response``, ``rating``).
    When it holds any, ``ppo prepare`` and ``ppo validate`` make a pair version of them beside
    the prompts (``feedback/`` in ``data.interim_dir`` and ``data.prepared_dir``), split by
    prompt with ``data.eval_fraction``, and ``ppo reward`` trains a reward model on it."""
    max_pairs_per_prompt: int = bounded(64, ge=1, most=MAX_ROWS)
    """Most preference pairs the ratings of one prompt make (each liked reply against each
    disliked one would make ``liked x disliked``: 600 ratings, 90,000 pairs); the rest are not
    made, and counted in the pair version's manifest (``ratings_capped_per_prompt``)."""
    max_rating_pairs: int = bounded(200_000, ge=1, most=MAX_ROWS)
    """Most preference pairs all ratings together make; the rest are counted
    (``ratings_capped_total``)."""


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
    min_train_pairs: int = bounded(32, ge=0, most=MAX_ROWS)
    """Fewest preference pairs the feedback's train split may hold (when there is feedback)."""
    min_eval_pairs: int = bounded(8, ge=0, most=MAX_ROWS)
    """Fewest held-out preference pairs: the reward model's gate judges on them."""
    max_mirrored_share: float = bounded(0.05, ge=0, le=1)
    """Largest share of a feedback split's pairs that may be mirrored (the same prompt and
    replies, swapped, also a pair): some annotators disagree, but feedback that mostly
    contradicts itself trains a reward model to accuracy 0.5."""
    report_dir: str = "reports/validation"
    """Where the Data Docs HTML and ``summary.json`` go (written on failure too)."""


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
    min_gain_se: float | None = bounded(None, ge=0)
    """When set, the score gain must also be at least this many standard errors of the
    difference, ``sqrt(sd_c^2 / n_c + sd_b^2 / n_b)`` from each side's ``score_std`` and
    ``num_samples`` (replies of one prompt counted as independent): for a verifier reward,
    held-out accuracy that rose by more than chance. ``None``: off."""
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
    """New prompt and feedback files arriving while the pipeline runs unattended
    (``ppo ingest FILE...``, ``ppo ingest --feedback FILE...``)."""

    inbox_dir: str = "data/inbox"
    """Where ``ppo ingest`` puts checked files; the next run of the Prefect flow moves them into
    ``data.raw_dir`` under the retraining lock before it prepares, so that a file arriving during
    a run never changes the data that run is training on."""
    feedback_inbox_dir: str = "data/inbox-feedback"
    """Where ``ppo ingest --feedback`` puts checked preference feedback files; the next run of
    the Prefect flow moves them into ``data.feedback_dir`` with the prompt files, under the same
    lock. A folder of its own beside ``inbox_dir``, not inside it: no output may hold another."""
    rejected_dir: str = "data/rejected"
    """Where the flow sets aside the files a run took from the inboxes when validation rejects
    the data they made (one folder a run, with the failed expectations; feedback files in its
    ``feedback/``), so that ``data.raw_dir`` and ``data.feedback_dir`` are again what the
    production model was trained on and later files are not held up by them."""


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
    reward_timeout: float = bounded(86400.0, ge=0)
    """Seconds ``reward`` may run, each attempt (training the reward model on the feedback; the
    flow retries a failed one once, and it resumes from its checkpoints)."""
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
class RewardGateConfig:
    """When a newly trained reward model replaces the current one (``ppo reward``)."""

    min_accuracy: float = bounded(0.6, ge=0, le=1)
    """Held-out pair accuracy a reward model needs at least, whatever the incumbent's."""
    max_accuracy_drop: float = bounded(0.0, ge=0, le=1)
    """How far the new model's held-out accuracy may fall below the incumbent's, both measured
    on the same held-out pairs (0: it must be at least as accurate)."""


@dataclass
class RewardModelConfig:
    """The reward model trained from preference feedback (``ppo reward``), its versions and
    its gate. PPO uses it with ``model.reward=reward:current``."""

    base: str | None = None
    """Model folder the reward model starts from: a causal LM whose trunk is kept and given a
    new scalar head; ``None`` is ``model.policy`` (the policy's base)."""
    lora: bool = False
    """Train LoRA adapters on the trunk (rank ``lora_rank``, every linear layer) and the whole
    head instead of every weight; the version is saved with the adapters merged in."""
    lora_rank: int = bounded(8, gt=0, most=65_536)
    """Rank of each adapter with ``lora``."""
    lora_alpha: float = bounded(16.0, gt=0)
    """Scale of each adapter (``alpha / rank``) with ``lora``."""
    epochs: int = bounded(5, gt=0, most=10_000)
    """Passes over the train pairs."""
    batch_size: int = bounded(16, gt=0, most=MAX_ROWS)
    """Pairs per optimizer step (per rank under torchrun); the loss of a step is the sum over its
    pairs divided by the step's global pair count, whatever ``micro_batch_size``."""
    micro_batch_size: int = bounded(8, gt=0, most=MAX_ROWS)
    """Pairs per forward pass; a memory setting that never changes the gradient."""
    lr: float = bounded(3e-4, gt=0, lt=1)
    """AdamW learning rate (the default suits the tiny default's full weights; a pretrained
    model of 100M+ parameters wants about 1e-5 in full, 1e-4 with ``lora``)."""
    weight_decay: float = bounded(0.0, ge=0)
    """AdamW weight decay."""
    margin: float = bounded(0.0, ge=0)
    """Margin of the loss ``-log sigmoid(r_chosen - r_rejected - margin)`` (0: none)."""
    max_grad_norm: float | None = bounded(1.0, gt=0)
    """Gradient norm clip (``None``: none)."""
    seed: int = bounded(0, most=MAX_SEED)
    """Seed of the head's initialisation and the pair shuffles."""
    checkpoint_every: int = bounded(1, gt=0, most=10_000)
    """Save a checkpoint after this many epochs; a killed run resumes from the newest."""
    output_dir: str = "models/reward_candidate"
    """Where ``ppo reward`` writes the newly trained reward model before the gate judges it."""
    checkpoint_dir: str = "models/reward_checkpoints"
    """The reward model's training checkpoints."""
    versions_dir: str = "models/rewards"
    """The promoted reward versions (``r0001``, ...) and their ``registry.json``."""
    report_dir: str = "reports/reward"
    """``metrics.json`` (held-out accuracy, margin, calibration) and the gate's decision."""
    gate: RewardGateConfig = field(default_factory=RewardGateConfig)
