"""The embedded default policy: a tiny GPT-2 warm-started on generated movie-review sentences.

Everything here is built locally, from code, with no download (docs/design.md section 6): the corpus
of :mod:`ppo_core.base_sources.review_grammar` (short reviews of mixed sentiment) trains a byte-level
BPE tokenizer and a 2-layer GPT-2 with plain causal-LM loss in well under a minute on a laptop
CPU. PPO then pushes the reviews towards positive sentiment, as in the classic TRL sentiment
example, with ``ppo_core.rewards.scorers.SentimentScorer`` as the reward.

Text format the model is trained on (and the one rollouts must use)::

    <|bos|> review text <|eos|>

The tokenizer's post-processor prepends ``<|bos|>`` whenever ``add_special_tokens=True`` (the
default), so ``tokenizer(prompts, padding=True)`` yields left-padded, bos-prefixed prompts ready
for ``generate``. EOS is never added by the tokenizer; the model emits it to end a review.

Heavy imports (transformers, tokenizers) live in this module only; it is imported on demand.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ppo_core.base_sources.review_grammar import generate_review_corpus
from ppo_core.files import atomic_folder
from ppo_core.files.artifacts import TINY_DEFAULT_RECORD

__all__ = ["build_tiny_default", "tiny_gpt2_config", "train_tokenizer"]

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
UNK_TOKEN = "<|unk|>"
# Trained first, so their ids are fixed: pad 0, bos 1, eos 2, unk 3.
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)


def train_tokenizer(texts: list[str], vocab_size: int = 1024, model_max_length: int = 64):
    """Train a byte-level BPE tokenizer on ``texts``; return a ``PreTrainedTokenizerFast``.

    Special tokens: pad ``<|pad|>`` (id 0), bos ``<|bos|>`` (1), eos ``<|eos|>`` (2), unk
    ``<|unk|>`` (3; byte-level BPE spells any unseen word in bytes, so it never occurs). Encoding
    with ``add_special_tokens=True`` prepends bos; padding is on the left for generation.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


def tiny_gpt2_config(
    vocab_size: int,
    n_layer: int = 2,
    n_embd: int = 128,
    n_head: int = 4,
    n_positions: int = 64,
    **overrides: Any,
):
    """Return a ``GPT2Config`` for the tiny default: dropout off (docs/design.md section 8), special
    token ids pad 0, bos 1, eos 2 (those of ``train_tokenizer``). ``overrides`` win."""
    from transformers import GPT2Config

    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_positions=n_positions,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        summary_first_dropout=0.0,
        bos_token_id=SPECIAL_TOKENS.index(BOS_TOKEN),
        eos_token_id=SPECIAL_TOKENS.index(EOS_TOKEN),
        pad_token_id=SPECIAL_TOKENS.index(PAD_TOKEN),
        tie_word_embeddings=True,
    )
    kwargs.update(overrides)
    return GPT2Config(**kwargs)


def _encode_corpus(tokenizer, texts: list[str], n_positions: int) -> tuple[torch.Tensor, ...]:
    """Encode ``bos + text + eos`` right-padded; return (input_ids, attention_mask, labels),
    each [N, L], labels -100 at padding."""
    eos_id = tokenizer.eos_token_id
    encodings = tokenizer.backend_tokenizer.encode_batch(texts)  # adds bos (post-processor)
    rows = [[*enc.ids, eos_id] for enc in encodings]
    longest = max(len(r) for r in rows)
    if longest > n_positions:
        raise ValueError(
            f"a training review is {longest} tokens long but n_positions is "
            f"{n_positions}; raise n_positions or shorten the grammar."
        )
    ids = torch.full((len(rows), longest), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
    return ids, mask, labels


def _write_generation_config(model, tokenizer) -> None:
    """Pin the sampling distribution: pure sampling at temperature 1 (no hidden top-k 50)."""
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        do_sample=True,
        top_k=0,
        top_p=1.0,
        temperature=1.0,
        max_new_tokens=16,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def build_tiny_default(
    output_dir: str | Path,
    seed: int = 0,
    n_sentences: int = 20000,
    steps: int = 400,
    batch_size: int = 64,
    lr: float = 3e-3,
    warmup_steps: int = 30,
    vocab_size: int = 1024,
    n_layer: int = 2,
    n_embd: int = 128,
    n_head: int = 4,
    n_positions: int = 64,
    num_threads: int | None = 1,
    overwrite: bool = True,
) -> Path:
    """Build the tiny default policy into ``output_dir`` and return its path.

    Steps: generate the corpus, train the tokenizer, build ``GPT2LMHeadModel``, train it with
    causal-LM loss on ``bos + review + eos`` (AdamW, linear warmup then cosine decay to 10%),
    save model (safetensors), tokenizer, generation config and ``tiny_default.json`` with
    :func:`ppo_core.files.atomic_folder`, so ``output_dir`` is either absent, the old build, or
    the complete new build. Deterministic given ``seed`` and ``num_threads``.

    ``num_threads`` defaults to 1 (``None`` means the default too): the matrices are so small that a second thread gains little
    (about 20 s with 2 threads against 27 s with 1 on a quiet 2-core CPU), while two threads per
    process on a busy machine (tests or flows running beside it) slowed the build tenfold in
    measurement. The previous torch thread count is restored afterwards.
    """
    output_dir = Path(output_dir).resolve()
    if output_dir.exists() and not overwrite:
        raise FileExistsError(f"{output_dir} exists; pass overwrite=True or remove it first.")
    settings = _TinySettings(
        seed, n_sentences, steps, batch_size, lr, warmup_steps, vocab_size, n_layer, n_embd,
        n_head, n_positions,
    )  # fmt: skip
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(num_threads or 1)
    try:
        return atomic_folder(output_dir, functools.partial(_build_into, settings=settings))
    finally:
        torch.set_num_threads(previous_threads)


@dataclass(frozen=True)
class _TinySettings:
    """The arguments of :func:`build_tiny_default` that shape the model and its warm start."""

    seed: int
    n_sentences: int
    steps: int
    batch_size: int
    lr: float
    warmup_steps: int
    vocab_size: int
    n_layer: int
    n_embd: int
    n_head: int
    n_positions: int


def _build_into(tmp_dir: Path, settings: _TinySettings) -> None:
    """Corpus, tokenizer, model, warm start, then every file of the folder into ``tmp_dir``."""
    from transformers import GPT2LMHeadModel

    s = settings
    torch.manual_seed(s.seed)
    texts = generate_review_corpus(s.n_sentences, s.seed)
    tokenizer = train_tokenizer(texts, vocab_size=s.vocab_size, model_max_length=s.n_positions)
    ids, mask, labels = _encode_corpus(tokenizer, texts, s.n_positions)

    config = tiny_gpt2_config(len(tokenizer), s.n_layer, s.n_embd, s.n_head, s.n_positions)
    model = GPT2LMHeadModel(config)
    # transformers finds no loss for the class name GPT2LMHeadModel and logs that it falls
    # back to the causal-LM loss; naming that loss says the same without the warning
    model.loss_type = "ForCausalLM"
    losses = _warm_start(model, ids, mask, labels, s)

    _write_generation_config(model, tokenizer)
    model.save_pretrained(tmp_dir, safe_serialization=True)
    tokenizer.save_pretrained(tmp_dir)
    tail = losses[-20:] or [float("nan")]
    record = {
        "seed": s.seed,
        "n_sentences": s.n_sentences,
        "steps": s.steps,
        "batch_size": s.batch_size,
        "lr": s.lr,
        "vocab_size": len(tokenizer),
        "n_layer": s.n_layer,
        "n_embd": s.n_embd,
        "n_head": s.n_head,
        "n_positions": s.n_positions,
        "n_params": sum(p.numel() for p in model.parameters()),
        "max_train_tokens": int(mask.sum(dim=1).max()),
        "token_ids": {
            "pad": tokenizer.pad_token_id,
            "bos": tokenizer.bos_token_id,
            "eos": tokenizer.eos_token_id,
            "unk": tokenizer.unk_token_id,
        },
        "format": "bos + review + eos; tokenizer prepends bos, pads left",
        "initial_loss": sum(losses[:5]) / len(losses[:5]) if losses else float("nan"),
        "final_loss": sum(tail) / len(tail),
        # no build time: the folder is a DVC output, the same bytes for the same inputs
        "num_threads": torch.get_num_threads(),
    }
    (tmp_dir / TINY_DEFAULT_RECORD).write_text(json.dumps(record, indent=2) + "\n")


def _warm_start(
    model: torch.nn.Module, ids: Tensor, mask: Tensor, labels: Tensor, s: _TinySettings
) -> list[float]:
    """Causal-LM training on the encoded corpus: AdamW, linear warm-up then cosine decay to 10%,
    batches drawn without replacement from seeded shuffles, each trimmed to its longest row.
    Leaves ``model`` in eval mode; returns each step's loss."""
    model.train()  # dropout is 0.0, so train and eval modes compute the same function
    optimizer = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.01, betas=(0.9, 0.98))

    def lr_factor(step: int) -> float:
        if step < s.warmup_steps:
            return (step + 1) / s.warmup_steps
        progress = (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1.0 + torch.cos(torch.tensor(torch.pi * progress)).item())

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    data_gen = torch.Generator().manual_seed(s.seed)
    rows = len(ids)
    order = torch.randperm(rows, generator=data_gen)
    cursor, losses = 0, []
    for _ in range(s.steps):
        if cursor + s.batch_size > len(order):
            order, cursor = torch.randperm(rows, generator=data_gen), 0
        idx = order[cursor : cursor + s.batch_size]
        cursor += s.batch_size
        width = int(mask[idx].sum(dim=1).max())  # trim the batch to its longest row
        out = model(
            input_ids=ids[idx, :width],
            attention_mask=mask[idx, :width],
            labels=labels[idx, :width],
        )
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(out.loss.item())
    model.eval()
    return losses
