"""The embedded default policy: a tiny GPT-2 warm-started on generated movie-review sentences.

Everything here is built locally, from code, with no download (DESIGN.md section 6): a template
grammar writes a corpus of short reviews of mixed sentiment, a byte-level BPE tokenizer is trained
on it, and a 2-layer GPT-2 learns it with plain causal-LM loss in well under a minute on a laptop
CPU. PPO then pushes the reviews towards positive sentiment, as in the classic TRL sentiment
example, with ``ppo_core.modeling.rewards.SentimentScorer`` as the reward.

Text format the model is trained on (and the one rollouts must use)::

    <|bos|> review text <|eos|>

The tokenizer's post-processor prepends ``<|bos|>`` whenever ``add_special_tokens=True`` (the
default), so ``tokenizer(prompts, padding=True)`` yields left-padded, bos-prefixed prompts ready
for ``generate``. EOS is never added by the tokenizer; the model emits it to end a review.

Heavy imports (transformers, tokenizers) live in this module only; it is imported on demand.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
UNK_TOKEN = "<|unk|>"
# Trained first, so their ids are fixed: pad 0, bos 1, eos 2, unk 3.
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)

# ---------------------------------------------------------------------------------------------
# Grammar. Every word list was checked against the VADER lexicon (the default scorer): positive
# adjectives score > 0, negative ones < 0, neutral adjectives, subjects, intros and adverbs are
# absent from it, so the prompts (intro + subject + verb) are exactly neutral (compound 0) and a
# review's sentiment comes from the words the model chooses to continue with.
# ---------------------------------------------------------------------------------------------

# (noun phrase, is_plural)
_SUBJECTS: tuple[tuple[str, bool], ...] = (
    ("movie", False), ("film", False), ("story", False), ("plot", False), ("acting", False),
    ("cast", False), ("script", False), ("dialogue", False), ("soundtrack", False),
    ("music", False), ("score", False), ("ending", False), ("opening", False),
    ("director", False), ("lead actor", False), ("lead actress", False),
    ("cinematography", False), ("camera work", False), ("pacing", False), ("editing", False),
    ("sequel", False), ("premise", False), ("twist", False), ("final scene", False),
    ("first half", False), ("second act", False), ("set design", False), ("writing", False),
    ("screenplay", False), ("finale", False), ("tone", False), ("lighting", False),
    ("atmosphere", False), ("animation", False), ("chemistry", False), ("narrator", False),
    ("action", False), ("visuals", True), ("effects", True), ("characters", True),
    ("costumes", True), ("performances", True), ("songs", True),
)
# Subjects that read naturally after "this" (a whole work rather than a part of one).
_WORKS = ("movie", "film", "story", "sequel", "script", "screenplay", "soundtrack")
_PEOPLE = ("director", "lead actor", "lead actress", "cast", "narrator")

_POSITIVE = (
    "great", "good", "wonderful", "excellent", "brilliant", "amazing", "beautiful", "fantastic",
    "superb", "delightful", "charming", "enjoyable", "fun", "funny", "clever", "powerful",
    "impressive", "stunning", "lovely", "fresh", "perfect", "smart", "inspiring", "gorgeous",
    "entertaining", "thrilling", "strong", "sweet", "magnificent", "engaging", "outstanding",
    "terrific", "pleasant", "hilarious", "heartfelt", "elegant", "exciting", "creative",
    "original", "splendid", "fascinating", "satisfying", "nice", "warm", "compelling",
)
_NEGATIVE = (
    "bad", "terrible", "awful", "boring", "dull", "weak", "poor", "horrible", "dreadful",
    "stupid", "messy", "ugly", "lame", "painful", "annoying", "disappointing", "awkward",
    "pathetic", "confusing", "ridiculous", "dumb", "weird", "lazy", "sad", "miserable",
    "frustrating", "irritating", "worthless", "useless", "empty", "forced", "sluggish",
    "depressing", "offensive",
)
_NEUTRAL = (
    "long", "short", "slow", "simple", "quiet", "dark", "loud", "fast", "ordinary", "typical",
    "unusual", "subtle", "familiar", "plain", "modern", "quick", "quirky", "straightforward",
    "small", "big", "dense", "minimal", "predictable", "different",
)
# Degree adverbs: absent from the VADER lexicon, though VADER's booster rule scales what follows.
_ADVERBS = ("really", "very", "quite", "rather", "somewhat", "extremely", "fairly", "so", "a bit")
# Sentence openers before a lowercase subject; none of them carries VADER sentiment.
_NEGATED_ADVERBS = ("really", "very", "so")
_INTROS = ("Overall, ", "Frankly, ", "Personally, ", "In my opinion, ", "To me, ", "In the end, ",
           "At first, ", "All in all, ")
_WORK_NOUNS = ("movie", "film", "story", "sequel", "show")

# Short second sentences of two-sentence reviews, by sentiment.
_CLOSERS = {
    "pos": ("I loved it.", "I enjoyed it.", "I would recommend it.", "I liked it a lot.",
            "A great time.", "Worth a watch.", "What a treat."),
    "neg": ("I hated it.", "What a waste of time.", "I was bored.", "I disliked it.",
            "Skip this one.", "I regret watching it."),
    "neu": ("I watched it twice.", "It ran long.", "I saw it last week.",
            "I watched it at home.", "I saw it with friends."),
}

# Sentiment mix of reviews: slightly more positive than negative so that the compound score of
# the model's samples averages about 0.1 (measured by bench/tiny_default_report.py).
_POLARITY_WEIGHTS = {"pos": 0.45, "neg": 0.31, "neu": 0.24}
_OPPOSITE = {"pos": "neg", "neg": "pos", "neu": "neu"}


def _adjectives(polarity: str) -> tuple[str, ...]:
    return {"pos": _POSITIVE, "neg": _NEGATIVE, "neu": _NEUTRAL}[polarity]


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _capitalize(text: str) -> str:
    return text[:1].upper() + text[1:]


def _be(plural: bool, past: bool) -> str:
    if past:
        return "were" if plural else "was"
    return "are" if plural else "is"


class _ReviewGrammar:
    """Draws one review at a time from the template grammar with a seeded ``random.Random``."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def choice(self, items):
        return self.rng.choice(items)

    def adj(self, polarity: str, adverb_p: float = 0.3) -> str:
        word = self.choice(_adjectives(polarity))
        if self.rng.random() < adverb_p:
            return f"{self.choice(_ADVERBS)} {word}"
        return word

    def subject(self) -> tuple[str, bool]:
        """A noun phrase with its determiner, lowercase, e.g. ``("this film", False)``."""
        noun, plural = self.choice(_SUBJECTS)
        det = "this" if (noun in _WORKS and self.rng.random() < 0.4) else "the"
        return f"{det} {noun}", plural

    def opener(self) -> tuple[str, bool]:
        """Optional intro + subject, sentence-initial, e.g. ``("Frankly, the plot", False)``."""
        phrase, plural = self.subject()
        if self.rng.random() < 0.3:
            return self.choice(_INTROS) + phrase, plural
        return _capitalize(phrase), plural

    def sentence(self, polarity: str) -> str:
        """One sentence whose VADER sentiment follows ``polarity`` (``pos``, ``neg``, ``neu``)."""
        rng = self.rng
        past = rng.random() < 0.6
        shape = rng.random()
        if shape < 0.30:  # "The movie was really great."
            subj, pl = self.opener()
            verb = _be(pl, past) if rng.random() < 0.8 else self.choice(("felt", "seemed"))
            return f"{subj} {verb} {self.adj(polarity)}."
        if shape < 0.48:  # "This film was fun and clever."
            subj, pl = self.opener()
            a, b = self.adj(polarity), self.adj(polarity, adverb_p=0.0)
            return f"{subj} {_be(pl, past)} {a} and {b}."
        if shape < 0.64:  # "I thought the acting was good." / "I found the plot dull."
            noun, pl = self.choice(_SUBJECTS)
            form = rng.random()
            if form < 0.45:
                return f"I thought the {noun} {_be(pl, past)} {self.adj(polarity)}."
            if form < 0.8:
                return f"I found the {noun} {self.adj(polarity)}."
            return f"I felt that the {noun} {_be(pl, past)} {self.adj(polarity)}."
        if shape < 0.74:  # "It was a great movie." / "The director did a poor job."
            if rng.random() < 0.5:
                word = self.choice(_adjectives(polarity))
                return f"It {_be(False, past)} {_article(word)} {word} {self.choice(_WORK_NOUNS)}."
            person = self.choice(_PEOPLE)
            word = self.choice(_adjectives(polarity))
            return f"The {person} did {_article(word)} {word} job."
        if shape < 0.84 and polarity != "neu":  # "The plot was not good." (negation flips)
            subj, pl = self.opener()
            word = self.choice(_adjectives(_OPPOSITE[polarity]))
            if rng.random() < 0.2:
                word = f"{self.choice(_NEGATED_ADVERBS)} {word}"
            return f"{subj} {_be(pl, past)} not {word}."
        # "The movie is good, but the plot is boring.": VADER weights the clause after "but"
        # more, so the review's polarity is the second adjective's.
        subj, pl = self.opener()
        noun2, pl2 = self.choice(_SUBJECTS)
        first = self.adj(_OPPOSITE[polarity], adverb_p=0.15)
        second = self.adj(polarity, adverb_p=0.15)
        return f"{subj} {_be(pl, past)} {first}, but the {noun2} {_be(pl2, past)} {second}."

    def review(self) -> str:
        polarity = self.rng.choices(list(_POLARITY_WEIGHTS), weights=_POLARITY_WEIGHTS.values())[0]
        first = self.sentence(polarity)
        # A short second sentence after a short first one: the continuation of a prompt must
        # fit in 16 new tokens, EOS included.
        if len(first.split()) <= 7 and self.rng.random() < 0.35:
            # "... too" only after a plain sentence: "The plot was not dull. The cast was
            # great too." reads wrong.
            if self.rng.random() < 0.6 or " not " in first or " but " in first:
                return f"{first} {self.choice(_CLOSERS[polarity])}"
            noun, pl = self.choice(_SUBJECTS)
            return f"{first} The {noun} {_be(pl, True)} {self.adj(polarity, 0.0)} too."
        return first


def generate_review_corpus(n_sentences: int, seed: int) -> list[str]:
    """Return ``n_sentences`` short movie reviews of mixed sentiment, deterministic in ``seed``.

    Each item is one sentence or a short two-sentence review ending with a period. About 45%
    are positive, 31% negative and 24% neutral (with mixed "A, but B" and negated sentences).
    """
    if n_sentences < 0:
        raise ValueError(f"n_sentences must be >= 0, got {n_sentences}")
    grammar = _ReviewGrammar(random.Random(seed))
    return [grammar.review() for _ in range(n_sentences)]


def _prompt_pool() -> list[str]:
    """All distinct neutral review openings of 2-5 words, in a fixed (sorted) order."""
    pool: set[str] = set()
    for noun, plural in _SUBJECTS:
        dets = ("the", "this") if noun in _WORKS else ("the",)
        for det in dets:
            phrase = f"{det} {noun}"
            pool.add(_capitalize(phrase))
            for past in (True, False):
                pool.add(f"{_capitalize(phrase)} {_be(plural, past)}")
            for verb in ("felt", "seemed"):
                pool.add(f"{_capitalize(phrase)} {verb}")
            for intro in _INTROS:
                pool.add(intro + phrase)
        pool.add(f"I thought the {noun}")
        pool.add(f"I found the {noun}")
        pool.add(f"I felt that the {noun}")
    pool.update(("It was a", "It is a"))
    return sorted(p for p in pool if 2 <= len(p.split()) <= 5)


def default_prompts(n: int, seed: int) -> list[str]:
    """Return ``n`` distinct neutral review openings, e.g. ``"I thought the acting"``.

    The pool (about 600 prompts) is shuffled with ``seed`` and its first ``n`` are returned, so
    for one seed a longer list extends a shorter one: ``default_prompts(k + m, s)[k:]`` is
    disjoint from ``default_prompts(k, s)`` (use it for held-out prompts). Prompts carry no
    trailing space and no special tokens.
    """
    pool = _prompt_pool()
    if not 0 <= n <= len(pool):
        raise ValueError(f"default_prompts: asked for n={n} prompts but the pool holds "
                         f"{len(pool)} distinct ones; ask for at most {len(pool)}.")
    random.Random(seed).shuffle(pool)
    return pool[:n]


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
    """Return a ``GPT2Config`` for the tiny default: dropout off (DESIGN.md section 8), special
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
        raise ValueError(f"a training review is {longest} tokens long but n_positions is "
                         f"{n_positions}; raise n_positions or shorten the grammar.")
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
    save model (safetensors), tokenizer, generation config and ``tiny_default.json`` into a
    temporary sibling folder, then rename it into place, so ``output_dir`` is either absent, the
    old build, or the complete new build. Deterministic given ``seed`` and ``num_threads``.

    ``num_threads`` defaults to 1 (``None`` means the default too): the matrices are so small that a second thread gains little
    (about 20 s with 2 threads against 27 s with 1 on a quiet 2-core CPU), while two threads per
    process on a busy machine (tests or flows running beside it) slowed the build tenfold in
    measurement. The previous torch thread count is restored afterwards.
    """
    from transformers import GPT2LMHeadModel

    start = time.perf_counter()
    output_dir = Path(output_dir).resolve()
    if output_dir.exists() and not overwrite:
        raise FileExistsError(f"{output_dir} exists; pass overwrite=True or remove it first.")
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(num_threads or 1)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.tmp-", dir=output_dir.parent))
    try:
        torch.manual_seed(seed)
        texts = generate_review_corpus(n_sentences, seed)
        tokenizer = train_tokenizer(texts, vocab_size=vocab_size, model_max_length=n_positions)
        ids, mask, labels = _encode_corpus(tokenizer, texts, n_positions)

        config = tiny_gpt2_config(len(tokenizer), n_layer, n_embd, n_head, n_positions)
        model = GPT2LMHeadModel(config)
        model.train()  # dropout is 0.0, so train and eval modes compute the same function
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01,
                                      betas=(0.9, 0.98))

        def lr_factor(step: int) -> float:
            if step < warmup_steps:
                return (step + 1) / warmup_steps
            progress = (step - warmup_steps) / max(1, steps - warmup_steps)
            return 0.1 + 0.9 * 0.5 * (1.0 + torch.cos(torch.tensor(torch.pi * progress)).item())

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
        data_gen = torch.Generator().manual_seed(seed)
        order = torch.randperm(len(texts), generator=data_gen)
        cursor, losses = 0, []
        for _ in range(steps):
            if cursor + batch_size > len(order):
                order, cursor = torch.randperm(len(texts), generator=data_gen), 0
            idx = order[cursor : cursor + batch_size]
            cursor += batch_size
            width = int(mask[idx].sum(dim=1).max())  # trim the batch to its longest row
            out = model(input_ids=ids[idx, :width], attention_mask=mask[idx, :width],
                        labels=labels[idx, :width])
            optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            losses.append(out.loss.item())
        model.eval()

        _write_generation_config(model, tokenizer)
        model.save_pretrained(tmp_dir, safe_serialization=True)
        tokenizer.save_pretrained(tmp_dir)
        tail = losses[-20:] or [float("nan")]
        record = {
            "seed": seed,
            "n_sentences": n_sentences,
            "steps": steps,
            "batch_size": batch_size,
            "lr": lr,
            "vocab_size": len(tokenizer),
            "n_layer": n_layer,
            "n_embd": n_embd,
            "n_head": n_head,
            "n_positions": n_positions,
            "n_params": sum(p.numel() for p in model.parameters()),
            "max_train_tokens": int(mask.sum(dim=1).max()),
            "token_ids": {"pad": tokenizer.pad_token_id, "bos": tokenizer.bos_token_id,
                          "eos": tokenizer.eos_token_id, "unk": tokenizer.unk_token_id},
            "format": "bos + review + eos; tokenizer prepends bos, pads left",
            "final_loss": sum(tail) / len(tail),
            "num_threads": torch.get_num_threads(),
            "elapsed_seconds": round(time.perf_counter() - start, 3),
        }
        (tmp_dir / "tiny_default.json").write_text(json.dumps(record, indent=2) + "\n")
        _move_into_place(tmp_dir, output_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    finally:
        torch.set_num_threads(previous_threads)
    return output_dir


def _move_into_place(tmp_dir: Path, output_dir: Path) -> None:
    """Rename ``tmp_dir`` to ``output_dir``; an existing build is moved aside first and removed
    only after the new one is in place (a rename cannot replace a non-empty folder)."""
    if not output_dir.exists():
        os.replace(tmp_dir, output_dir)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.old-", dir=output_dir.parent))
    os.replace(output_dir, old / "previous")
    try:
        os.replace(tmp_dir, output_dir)
    except BaseException:
        os.replace(old / "previous", output_dir)  # put the old build back
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)
