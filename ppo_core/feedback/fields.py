"""The fields of a feedback row and the one error every feedback reader raises (layer 2); the
row format is described in :mod:`ppo_core.feedback.rows`."""

from __future__ import annotations

from ppo_core.prompts import CHAT_FIELD, PromptFileError

__all__ = [
    "DISLIKED_WORDS",
    "FEEDBACK_FIELDS",
    "FEEDBACK_SUFFIXES",
    "FIELDS_HELP",
    "LIKED_WORDS",
    "LIMIT_HINT",
    "OPTIONAL_FIELDS",
    "PAIR_FIELDS",
    "PROMPT_FIELD",
    "RATING_FIELDS",
    "RATING_HELP",
    "FeedbackFileError",
]

FEEDBACK_SUFFIXES = (".jsonl", ".parquet")
"""The suffixes of the files :func:`ppo_core.feedback.rows.feedback_sources` lists; other files are not feedback."""

PROMPT_FIELD = "prompt"
PAIR_FIELDS = ("chosen", "rejected")
RATING_FIELDS = ("response", "rating")
OPTIONAL_FIELDS = ("id", "source")
FEEDBACK_FIELDS = (PROMPT_FIELD, CHAT_FIELD, *PAIR_FIELDS, *RATING_FIELDS, *OPTIONAL_FIELDS)
"""Every field (JSONL) or column (Parquet) a feedback row may have."""
FIELDS_HELP = (
    "a row has prompt or messages; chosen and rejected (a pair) or response and rating "
    "(a rating); and optionally id and source"
)

LIKED_WORDS = ("up", "like", "thumbs_up")
"""The words (any case) of a liked ``rating``."""
DISLIKED_WORDS = ("down", "dislike", "thumbs_down")
"""The words (any case) of a disliked ``rating``."""
RATING_HELP = (
    "a rating is a number (>0 liked, <0 disliked, 0 neutral), true or false, or one of "
    f"{', '.join(LIKED_WORDS + DISLIKED_WORDS)}"
)
LIMIT_HINT = "; split the file or raise the limit"


class FeedbackFileError(PromptFileError):
    """A feedback file is missing or malformed; the message names the file and line or row.

    A :class:`~ppo_core.prompts.PromptFileError`, so that code which reports a bad prompt file
    in one line (the ``ppo`` command) reports this one the same way.
    """
