"""Reading preference feedback (layer 2): what people said about a model's replies, from the
``.jsonl`` and ``.parquet`` files of a folder such as ``data/feedback/``.

A row holds a prompt, as a prompt file does (:mod:`ppo_core.prompts`): a plain ``prompt`` string
or a chat, ``messages``, a list of ``{"role", "content"}`` turns (in Parquet a list column or
the JSON text of the list). Besides the prompt a row is one of two kinds:

- a **pair** (:class:`PreferencePair`): ``chosen`` and ``rejected``, two replies to the prompt,
  the first preferred;
- a **rating** (:class:`Rating`): one ``response`` and its ``rating``: a number (above 0 liked,
  below 0 disliked, 0 neutral), a bool (true liked) or one of the words ``up``, ``like``,
  ``thumbs_up`` (liked), ``down``, ``dislike``, ``thumbs_down`` (disliked), in any case.

Either kind may carry an ``id`` (a string, or an integer read as its digits) and a ``source``
(a string). Any other field is an error naming it, so that a misspelt ``choosen`` is never
read as a row without that field; so is a row of both kinds or of neither, one with both
``prompt`` and ``messages``, a value of the wrong type, a rating that is NaN or infinite, or a
word not in the list. A null value (JSON ``null``, a Parquet null) counts as an absent field:
in Parquet every row has every column, and a file mixing pairs and ratings leaves the other
kind's columns null. Empty strings are kept: validation reports them, reading does not.

Every error is a :class:`FeedbackFileError` on one line naming the file and the line (JSONL,
counted from 1, blank lines included) or the row (Parquet, counted from 0 as in
:func:`~ppo_core.prompts.load_prompts`), the field and what is wrong with its value.

A file is bounded before it is read whole, as a prompt file is: at most ``max_rows`` rows and
``max_bytes`` bytes. A JSONL file is measured by its size and then line by line (a line at most
:data:`~ppo_core.prompts.MAX_LINE_BYTES`); a Parquet file first by its metadata (rows, the
uncompressed size of its data), then by the length of its text, read as dictionaries so that a
small file holding one long string many times is refused without the strings being built.

Ratings become pairs by one rule (:func:`pairs_from_ratings`): ratings are grouped by the key
of their prompt, a normaliser the caller passes (whitespace-normalised text, the canonical JSON
of a chat), so that the same question asked twice gathers its replies. Within a prompt every
liked reply is paired with every disliked one, the liked reply as ``chosen``, in the order the
ratings came. A reply (the same text) rated both liked and disliked for the same prompt is
contradictory and enters no pair; neutral ratings enter none either; and a liked or disliked
reply whose prompt has no reply of the other kind stays unpaired.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ppo_core.feedback.fields import (
    DISLIKED_WORDS,
    FEEDBACK_FIELDS,
    FEEDBACK_SUFFIXES,
    FIELDS_HELP,
    LIKED_WORDS,
    PAIR_FIELDS,
    PROMPT_FIELD,
    RATING_FIELDS,
    RATING_HELP,
    FeedbackFileError,
)
from ppo_core.feedback.records import jsonl_records, parquet_records
from ppo_core.files import entry_kind, printable
from ppo_core.prompts import (
    CHAT_FIELD,
    MAX_BYTES_PER_FILE,
    MAX_ROWS_PER_FILE,
    Prompt,
    PromptFileError,
    chat_json,
    parse_messages,
)

__all__ = [
    "PreferencePair",
    "Rating",
    "feedback_sources",
    "load_feedback_file",
    "mirrored_pairs",
    "pairs_from_ratings",
]


@dataclass(frozen=True)
class PreferencePair:
    """Two replies to one prompt, ``chosen`` preferred to ``rejected``: a pair row as read, or
    one that :func:`pairs_from_ratings` made from two ratings."""

    prompt: Prompt
    chosen: str
    rejected: str
    id: str | None = None
    source: str | None = None


@dataclass(frozen=True)
class Rating:
    """One reply to a prompt and whether it was liked: ``True``, ``False``, or ``None`` for a
    neutral rating (0), which :func:`pairs_from_ratings` does not use."""

    prompt: Prompt
    response: str
    liked: bool | None
    id: str | None = None
    source: str | None = None


def feedback_sources(folder: Path) -> list[Path]:
    """The feedback files of ``folder``, sorted by name: its entries ending ``.jsonl`` or
    ``.parquet`` that are regular files, or links to regular files (DVC's symlink cache makes
    those). Other files (a README, ``.gitkeep``) are not feedback and are left out; a missing
    folder has none.

    Raises:
        FeedbackFileError: ``folder`` is not a folder, or an entry with a feedback suffix is
            not a regular file (a FIFO, a device, a folder, a dangling link), saying what it
            is, before anything reads it: reading one would block, or never end.
    """
    folder = Path(folder)
    if not folder.exists():
        return []
    if not folder.is_dir():
        raise FeedbackFileError(f"{printable(str(folder))} is not a folder of feedback files")
    sources = sorted(path for path in folder.iterdir() if path.suffix in FEEDBACK_SUFFIXES)
    for path in sources:
        kind = entry_kind(path)
        if kind is not None:
            raise FeedbackFileError(
                f"{printable(str(path))} is {kind}, not a feedback file; feedback files are "
                "regular files (or links to them)"
            )
    return sources


def load_feedback_file(
    path: str | Path,
    *,
    max_rows: int = MAX_ROWS_PER_FILE,
    max_bytes: int = MAX_BYTES_PER_FILE,
) -> tuple[list[PreferencePair], list[Rating]]:
    """The pair rows and the rating rows of one ``.jsonl`` or ``.parquet`` feedback file, each
    in file order (a file may mix the two kinds). A file with no rows gives two empty lists.

    Raises:
        FeedbackFileError: a missing file, one that is not a regular file, an unknown suffix,
            more than ``max_rows`` rows or ``max_bytes`` bytes (module docstring), or a row that
            is not valid feedback, named by its line or row, field and problem.
    """
    path = Path(path)
    name = printable(str(path))
    if not path.exists() and not path.is_symlink():
        raise FeedbackFileError(f"feedback file {name} does not exist")
    kind = entry_kind(path)
    if kind is not None:
        raise FeedbackFileError(f"{name} is {kind}, not a feedback file")
    if path.suffix == ".jsonl":
        records = jsonl_records(path, name, max_rows, max_bytes)
    elif path.suffix == ".parquet":
        records = parquet_records(path, name, max_rows, max_bytes)
    else:
        raise FeedbackFileError(
            f"{name}: unknown feedback file type {path.suffix!r}; use .jsonl or .parquet"
        )
    pairs: list[PreferencePair] = []
    ratings: list[Rating] = []
    for where, record in records:
        row = _feedback_row(record, where)
        if isinstance(row, PreferencePair):
            pairs.append(row)
        else:
            ratings.append(row)
    return pairs, ratings


def pairs_from_ratings(
    ratings: list[Rating],
    prompt_key: Callable[[Prompt], str],
    per_prompt: int | None = None,
    total: int | None = None,
) -> tuple[list[PreferencePair], dict[str, int]]:
    """Preference pairs made from ratings, and counts of what happened to the ratings.

    The rule: ratings are grouped by ``prompt_key(rating.prompt)`` (the caller's normaliser,
    e.g. whitespace-normalised text or the canonical JSON of a chat). Within a group, every
    liked reply is paired with every disliked reply, the liked one as ``chosen``: liked replies
    in the order they first came, each with the disliked ones in the order they first came, and
    the groups in the order their first rating came. A reply is its text: the same text rated
    liked twice is one reply (its first rating gives the pair's prompt, id and source), so no
    pair is made twice. A text rated both liked and disliked for the same prompt is
    contradictory and is used in no pair. Neutral ratings are used in none.

    ``per_prompt`` caps the pairs of one group and ``total`` all of them (None: no cap): ``L``
    liked and ``D`` disliked replies could make ``L * D`` pairs, so 600 ratings of one prompt
    would make 90,000. A capped group keeps the pairs of liked ``i`` and disliked ``j`` with the
    smallest ``i + j`` (then ``i``), so that its pairs use as many distinct replies as they can,
    in the order above; pairs past a cap are not made, only counted.

    A pair's prompt and source are the liked rating's; its id is ``"<liked id>|<disliked id>"``
    when both ratings have one, else None.

    Returns:
        The pairs, and counts: ``ratings`` (all), ``liked``, ``disliked``, ``neutral``,
        ``contradictory`` (liked and disliked ratings of a contradictory reply), ``pairs``
        (made), ``unpaired`` (liked or disliked ratings, not contradictory, whose prompt had
        no usable reply of the other kind), ``capped_per_prompt`` and ``capped_total`` (pairs
        not made for ``per_prompt`` and for ``total``).
    """
    groups: dict[str, list[Rating]] = {}
    for rating in ratings:
        groups.setdefault(prompt_key(rating.prompt), []).append(rating)
    counts = {
        "ratings": len(ratings),
        "liked": sum(rating.liked is True for rating in ratings),
        "disliked": sum(rating.liked is False for rating in ratings),
        "neutral": sum(rating.liked is None for rating in ratings),
        "contradictory": 0,
        "pairs": 0,
        "unpaired": 0,
        "capped_per_prompt": 0,
        "capped_total": 0,
    }
    pairs: list[PreferencePair] = []
    for group in groups.values():
        liked = _replies(group, True)
        disliked = _replies(group, False)
        contradictory = liked.keys() & disliked.keys()
        counts["contradictory"] += sum(
            rating.liked is not None and rating.response in contradictory for rating in group
        )
        usable_liked = [rating for text, rating in liked.items() if text not in contradictory]
        usable_disliked = [rating for text, rating in disliked.items() if text not in contradictory]
        if not (usable_liked and usable_disliked):
            counts["unpaired"] += sum(
                rating.liked is not None and rating.response not in contradictory
                for rating in group
            )
            continue
        possible = len(usable_liked) * len(usable_disliked)
        wanted = possible if per_prompt is None else min(possible, per_prompt)
        counts["capped_per_prompt"] += possible - wanted
        room = wanted if total is None else max(0, min(wanted, total - len(pairs)))
        counts["capped_total"] += wanted - room
        for i, j in sorted(_diagonal_pairs(len(usable_liked), len(usable_disliked), room)):
            good, bad = usable_liked[i], usable_disliked[j]
            pair_id = f"{good.id}|{bad.id}" if good.id is not None and bad.id is not None else None
            pairs.append(
                PreferencePair(good.prompt, good.response, bad.response, pair_id, good.source)
            )
    counts["pairs"] = len(pairs)
    return pairs, counts


def _diagonal_pairs(liked: int, disliked: int, count: int) -> list[tuple[int, int]]:
    """The first ``count`` index pairs ``(i, j)``, ``i < liked``, ``j < disliked``, in the
    order of ``i + j``, then ``i``; never builds more than ``count``."""
    found: list[tuple[int, int]] = []
    for diagonal in range(liked + disliked - 1):
        for i in range(max(0, diagonal - disliked + 1), min(liked, diagonal + 1)):
            if len(found) == count:
                return found
            found.append((i, diagonal - i))
    return found


def mirrored_pairs(prompts: list[Any], chosen: list[Any], rejected: list[Any]) -> list[bool]:
    """For each pair, whether the swapped pair (its prompt, its rejected reply as chosen, its
    chosen as rejected; texts stripped) is also among them: feedback that contradicts itself.
    A value that is not a string is never mirrored (the pair suite fails it on its own)."""
    keys = [
        tuple(v.strip() if isinstance(v, str) else None for v in row)
        for row in zip(prompts, chosen, rejected, strict=True)
    ]
    present = set(keys)
    return [
        None not in key and key[1] != key[2] and (key[0], key[2], key[1]) in present for key in keys
    ]


def _replies(group: list[Rating], liked: bool) -> dict[str, Rating]:
    """The first rating of each distinct reply text of ``group`` rated ``liked``, in order."""
    replies: dict[str, Rating] = {}
    for rating in group:
        if rating.liked is liked:
            replies.setdefault(rating.response, rating)
    return replies


# --- one row --------------------------------------------------------------------------------


def _feedback_row(record: dict[str, Any], where: str) -> PreferencePair | Rating:
    """The pair or rating a row holds; ``where`` names the file and line or row.

    Unknown fields are refused even when null, so that a misspelt field is named wherever it
    is; the null ones of the rest then count as absent (module docstring).
    """
    unknown = [key for key in record if key not in FEEDBACK_FIELDS]
    if unknown:
        names = ", ".join(repr(printable(str(key))[:40]) for key in unknown)
        field_word = "field" if len(unknown) == 1 else "fields"
        raise FeedbackFileError(f"{where}: unknown {field_word} {names}; {FIELDS_HELP}")
    record = {key: value for key, value in record.items() if value is not None}
    prompt = _row_prompt(record, where)
    pair_fields = [field for field in PAIR_FIELDS if field in record]
    rating_fields = [field for field in RATING_FIELDS if field in record]
    if pair_fields and rating_fields:
        raise FeedbackFileError(
            f"{where}: has both a pair's fields ({', '.join(pair_fields)}) and a rating's "
            f"({', '.join(rating_fields)}); a row is one or the other"
        )
    kind_fields = PAIR_FIELDS if pair_fields else RATING_FIELDS if rating_fields else ()
    if not kind_fields:
        raise FeedbackFileError(
            f"{where}: neither a pair (chosen and rejected) nor a rating (response and rating)"
        )
    for field in kind_fields:
        if field not in record:
            kind = "pair" if pair_fields else "rating"
            present = (pair_fields or rating_fields)[0]
            raise FeedbackFileError(
                f"{where}: a {kind} row with {present!r} but no {field!r} (missing or null)"
            )
    row_id = _row_id(record.get("id"), where)
    source = _optional_text(record, "source", where)
    if pair_fields:
        chosen = _text(record, "chosen", where)
        rejected = _text(record, "rejected", where)
        return PreferencePair(prompt, chosen, rejected, row_id, source)
    response = _text(record, "response", where)
    return Rating(prompt, response, _liked(record["rating"], where), row_id, source)


def _row_prompt(record: dict[str, Any], where: str) -> Prompt:
    if PROMPT_FIELD in record and CHAT_FIELD in record:
        raise FeedbackFileError(
            f"{where}: has both {PROMPT_FIELD!r} and {CHAT_FIELD!r}; a row's prompt is one or "
            "the other"
        )
    if PROMPT_FIELD in record:
        return _text(record, PROMPT_FIELD, where)
    if CHAT_FIELD not in record:
        raise FeedbackFileError(
            f"{where}: no prompt: a row needs {PROMPT_FIELD!r} (text) or {CHAT_FIELD!r} "
            "(a list of turns)"
        )
    try:
        messages = parse_messages(record[CHAT_FIELD], where)
    except PromptFileError as exc:  # the same one-line message, as this module's error
        raise FeedbackFileError(str(exc)) from None
    _check_encodable(chat_json(messages), CHAT_FIELD, where)
    return messages


def _text(record: dict[str, Any], field: str, where: str) -> str:
    value = record[field]
    if not isinstance(value, str):
        raise FeedbackFileError(f"{where}: {field!r} must be a string, got {type(value).__name__}")
    _check_encodable(value, field, where)
    return value


def _optional_text(record: dict[str, Any], field: str, where: str) -> str | None:
    return _text(record, field, where) if field in record else None


def _row_id(value: Any, where: str) -> str | None:
    if value is None:
        return None
    # bool is an int in Python; an id of true is a mistake, not the id "True"
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise FeedbackFileError(
            f"{where}: 'id' must be a string or an integer, got {type(value).__name__}"
        )
    _check_encodable(value, "id", where)
    return value


def _liked(value: Any, where: str) -> bool | None:
    """Whether a rating's value says liked (True), disliked (False) or neutral (None)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):  # exact, however large: no float conversion
        return None if value == 0 else value > 0
    if isinstance(value, float):
        if not math.isfinite(value):
            raise FeedbackFileError(
                f"{where}: 'rating' is {value}, not a finite number; {RATING_HELP}"
            )
        return None if value == 0 else value > 0
    if isinstance(value, str):
        word = value.lower()
        if word in LIKED_WORDS:
            return True
        if word in DISLIKED_WORDS:
            return False
        raise FeedbackFileError(
            f"{where}: 'rating' is the unknown word {printable(value)[:40]!r}; {RATING_HELP}"
        )
    raise FeedbackFileError(
        f"{where}: 'rating' must be a number, a bool or a word, got {type(value).__name__}; "
        f"{RATING_HELP}"
    )


def _check_encodable(value: str, field: str, where: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a JSON escape of a lone surrogate, e.g. "\\ud800"
        raise FeedbackFileError(
            f"{where}: {field!r} holds a lone UTF-16 surrogate, which is not text"
        ) from None
