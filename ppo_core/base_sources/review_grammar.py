"""The review grammar behind the tiny default: generated movie reviews and neutral prompts.

A template grammar writes short reviews of mixed sentiment (the corpus the tiny default GPT-2 is
warm-started on) and lists the neutral review openings that serve as its prompts. Every word was
chosen against the VADER lexicon of :class:`ppo_core.rewards.scorers.SentimentScorer`, so a
prompt carries no sentiment and PPO can push the continuations towards positive. Pure Python,
deterministic in the seed; no model, tokenizer or download.
"""

from __future__ import annotations

import random

__all__ = ["default_prompts", "generate_review_corpus"]

# Every word list was checked against the VADER lexicon (the default scorer): positive
# adjectives score > 0, negative ones < 0, neutral adjectives, subjects, intros and adverbs are
# absent from it, so the prompts (intro + subject + verb) are exactly neutral (compound 0) and a
# review's sentiment comes from the words the model chooses to continue with.

# (noun phrase, is_plural)
_SUBJECTS: tuple[tuple[str, bool], ...] = (
    ("movie", False),
    ("film", False),
    ("story", False),
    ("plot", False),
    ("acting", False),
    ("cast", False),
    ("script", False),
    ("dialogue", False),
    ("soundtrack", False),
    ("music", False),
    ("score", False),
    ("ending", False),
    ("opening", False),
    ("director", False),
    ("lead actor", False),
    ("lead actress", False),
    ("cinematography", False),
    ("camera work", False),
    ("pacing", False),
    ("editing", False),
    ("sequel", False),
    ("premise", False),
    ("twist", False),
    ("final scene", False),
    ("first half", False),
    ("second act", False),
    ("set design", False),
    ("writing", False),
    ("screenplay", False),
    ("finale", False),
    ("tone", False),
    ("lighting", False),
    ("atmosphere", False),
    ("animation", False),
    ("chemistry", False),
    ("narrator", False),
    ("action", False),
    ("visuals", True),
    ("effects", True),
    ("characters", True),
    ("costumes", True),
    ("performances", True),
    ("songs", True),
)
# Subjects that read naturally after "this" (a whole work rather than a part of one).
_WORKS = ("movie", "film", "story", "sequel", "script", "screenplay", "soundtrack")
_PEOPLE = ("director", "lead actor", "lead actress", "cast", "narrator")

_POSITIVE = (
    "great",
    "good",
    "wonderful",
    "excellent",
    "brilliant",
    "amazing",
    "beautiful",
    "fantastic",
    "superb",
    "delightful",
    "charming",
    "enjoyable",
    "fun",
    "funny",
    "clever",
    "powerful",
    "impressive",
    "stunning",
    "lovely",
    "fresh",
    "perfect",
    "smart",
    "inspiring",
    "gorgeous",
    "entertaining",
    "thrilling",
    "strong",
    "sweet",
    "magnificent",
    "engaging",
    "outstanding",
    "terrific",
    "pleasant",
    "hilarious",
    "heartfelt",
    "elegant",
    "exciting",
    "creative",
    "original",
    "splendid",
    "fascinating",
    "satisfying",
    "nice",
    "warm",
    "compelling",
)
_NEGATIVE = (
    "bad",
    "terrible",
    "awful",
    "boring",
    "dull",
    "weak",
    "poor",
    "horrible",
    "dreadful",
    "stupid",
    "messy",
    "ugly",
    "lame",
    "painful",
    "annoying",
    "disappointing",
    "awkward",
    "pathetic",
    "confusing",
    "ridiculous",
    "dumb",
    "weird",
    "lazy",
    "sad",
    "miserable",
    "frustrating",
    "irritating",
    "worthless",
    "useless",
    "empty",
    "forced",
    "sluggish",
    "depressing",
    "offensive",
)
_NEUTRAL = (
    "long",
    "short",
    "slow",
    "simple",
    "quiet",
    "dark",
    "loud",
    "fast",
    "ordinary",
    "typical",
    "unusual",
    "subtle",
    "familiar",
    "plain",
    "modern",
    "quick",
    "quirky",
    "straightforward",
    "small",
    "big",
    "dense",
    "minimal",
    "predictable",
    "different",
)
# Degree adverbs: absent from the VADER lexicon, though VADER's booster rule scales what follows.
_ADVERBS = ("really", "very", "quite", "rather", "somewhat", "extremely", "fairly", "so", "a bit")
# Sentence openers before a lowercase subject; none of them carries VADER sentiment.
_NEGATED_ADVERBS = ("really", "very", "so")
_INTROS = (
    "Overall, ",
    "Frankly, ",
    "Personally, ",
    "In my opinion, ",
    "To me, ",
    "In the end, ",
    "At first, ",
    "All in all, ",
)
_WORK_NOUNS = ("movie", "film", "story", "sequel", "show")

# Short second sentences of two-sentence reviews, by sentiment.
_CLOSERS = {
    "pos": (
        "I loved it.",
        "I enjoyed it.",
        "I would recommend it.",
        "I liked it a lot.",
        "A great time.",
        "Worth a watch.",
        "What a treat.",
    ),
    "neg": (
        "I hated it.",
        "What a waste of time.",
        "I was bored.",
        "I disliked it.",
        "Skip this one.",
        "I regret watching it.",
    ),
    "neu": (
        "I watched it twice.",
        "It ran long.",
        "I saw it last week.",
        "I watched it at home.",
        "I saw it with friends.",
    ),
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
        polarity = self.rng.choices(
            list(_POLARITY_WEIGHTS), weights=list(_POLARITY_WEIGHTS.values())
        )[0]
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
        raise ValueError(
            f"default_prompts: asked for n={n} prompts but the pool holds "
            f"{len(pool)} distinct ones; ask for at most {len(pool)}."
        )
    random.Random(seed).shuffle(pool)
    return pool[:n]


def example_feedback(n: int, seed: int, ratings: bool = False) -> list[dict]:
    """``n`` rows of simulated feedback on replies to the default prompts, for trying the
    feedback loop on the tiny default: a reader who prefers positive reviews. Pair rows
    (``prompt``, ``chosen`` a positive continuation, ``rejected`` a negative one) or, with
    ``ratings``, rating rows (``prompt``, ``response``, ``rating`` 1 for a positive
    continuation and -1 for a negative one, two a prompt). Deterministic in ``seed``."""
    rng = random.Random(seed)
    grammar = _ReviewGrammar(rng)
    prompts = default_prompts(min(n, len(_prompt_pool())), seed)

    def continuation(polarity: str) -> str:
        return " " + grammar.adj(polarity) + "."

    rows: list[dict] = []
    for i in range(n):
        prompt = prompts[i % len(prompts)]
        if ratings:
            polarity = "pos" if i % 2 == 0 else "neg"
            prompt = prompts[(i // 2) % len(prompts)]
            rating = 1 if polarity == "pos" else -1
            rows.append({"prompt": prompt, "response": continuation(polarity), "rating": rating})
        else:
            rows.append(
                {"prompt": prompt, "chosen": continuation("pos"), "rejected": continuation("neg")}
            )
    return rows
