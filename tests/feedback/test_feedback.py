"""Preference feedback files (``ppo_core/feedback/``): pair and rating rows in JSONL and Parquet,
plain and chat prompts, one-line errors naming the file, the line or row and the field, the
size caps, which entries of a folder are feedback, and the rule that makes pairs of ratings."""

from __future__ import annotations

import json
import os

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ppo_core.feedback.fields import FeedbackFileError
from ppo_core.feedback.rows import (
    PreferencePair,
    Rating,
    feedback_sources,
    load_feedback_file,
    pairs_from_ratings,
)
from ppo_core.prompts import PromptFileError, chat_json, parquet_size

CHAT = [
    {"role": "system", "content": "You review films."},
    {"role": "user", "content": "Tell me about the movie."},
]
FIELDS_HELP = (
    "a row has prompt or messages; chosen and rejected (a pair) or response and rating "
    "(a rating); and optionally id and source"
)
RATING_HELP = (
    "a rating is a number (>0 liked, <0 disliked, 0 neutral), true or false, or one of "
    "up, like, thumbs_up, down, dislike, thumbs_down"
)


def write_jsonl(path, *rows):
    """One line a row: a dict is written as JSON, a string as it is (blank lines, bad JSON)."""
    lines = [row if isinstance(row, str) else json.dumps(row) for row in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def whitespace_key(prompt):
    """The normaliser a caller would pass: a text's whitespace collapsed, a chat's JSON."""
    return " ".join(prompt.split()) if isinstance(prompt, str) else chat_json(prompt)


def test_pair_rows_of_a_jsonl_file(tmp_path):
    path = write_jsonl(
        tmp_path / "pairs.jsonl",
        {"prompt": "Q", "chosen": "good", "rejected": "bad", "id": 7, "source": "app"},
        "",
        {"prompt": "R", "chosen": "", "rejected": "  ", "id": "a-1"},
        {"prompt": "S", "chosen": "x", "rejected": "y", "id": None, "source": None},
    )
    pairs, ratings = load_feedback_file(path)
    assert ratings == []
    assert pairs == [
        PreferencePair("Q", "good", "bad", id="7", source="app"),
        # empty replies are kept: validation reports them, reading does not
        PreferencePair("R", "", "  ", id="a-1"),
        # a null is an absent field
        PreferencePair("S", "x", "y"),
    ]


def test_rating_rows_and_the_rule_that_pairs_them(tmp_path):
    path = write_jsonl(
        tmp_path / "ratings.jsonl",
        {"prompt": "Q1", "response": "A", "rating": 1, "id": "r1", "source": "app"},
        {"prompt": "Q1 ", "response": "B", "rating": "thumbs_down", "id": "r2"},
        {"prompt": "Q1", "response": "C", "rating": -0.5, "id": 3},
        {"prompt": "Q1", "response": "A", "rating": "UP"},
        {"prompt": "Q2", "response": "D", "rating": True},
        {"prompt": "Q3", "response": "E", "rating": 1},
        {"prompt": "Q3", "response": "E", "rating": "dislike"},
        {"prompt": "Q3", "response": "F", "rating": 0},
        "",
        {"prompt": "Q3", "response": "G", "rating": False},
        {"prompt": "Q4", "response": "H", "rating": "Like"},
        {"prompt": "Q4", "response": "I", "rating": -2, "id": "x"},
    )
    pairs, ratings = load_feedback_file(path)
    assert pairs == []
    assert [rating.liked for rating in ratings] == [
        *(True, False, False, True, True, True, False, None, False, True, False)
    ]
    assert ratings[2] == Rating("Q1", "C", False, id="3")
    made, counts = pairs_from_ratings(ratings, whitespace_key)
    # By hand, grouped by normalised prompt:
    # Q1 ("Q1 " is Q1): liked A (twice: one reply, its first rating r1 counts), disliked B, C
    #    -> pairs A>B (r1|r2) and A>C (r1|3), source "app" from the liked rating.
    # Q2: liked D and nothing disliked -> D unpaired (1).
    # Q3: E liked and disliked -> contradictory (2 ratings); F neutral; G disliked, but no
    #    usable liked reply is left -> G unpaired (1).
    # Q4: liked H (no id), disliked I (id x) -> pair H>I with no id.
    # ratings 11 = liked 5 (A, A, D, E, H) + disliked 5 (B, C, E, G, I) + neutral 1 (F).
    assert made == [
        PreferencePair("Q1", "A", "B", id="r1|r2", source="app"),
        PreferencePair("Q1", "A", "C", id="r1|3", source="app"),
        PreferencePair("Q4", "H", "I"),
    ]
    assert counts == {
        "ratings": 11,
        "liked": 5,
        "disliked": 5,
        "neutral": 1,
        "contradictory": 2,
        "pairs": 3,
        "unpaired": 2,
        "capped_per_prompt": 0,
        "capped_total": 0,
    }


def test_the_rule_orders_pairs_as_the_ratings_came():
    ratings = [
        Rating("P", "no1", False),
        Rating("P", "yes1", True),
        Rating("P", "no2", False),
        Rating("P", "yes2", True),
    ]
    made, counts = pairs_from_ratings(ratings, whitespace_key)
    # liked replies in order, each with the disliked ones in order
    assert [(pair.chosen, pair.rejected) for pair in made] == [
        ("yes1", "no1"),
        ("yes1", "no2"),
        ("yes2", "no1"),
        ("yes2", "no2"),
    ]
    assert counts["pairs"] == 4 and counts["unpaired"] == 0
    assert pairs_from_ratings([], whitespace_key) == (
        [],
        dict.fromkeys(
            (
                "ratings",
                "liked",
                "disliked",
                "neutral",
                "contradictory",
                "pairs",
                "unpaired",
                "capped_per_prompt",
                "capped_total",
            ),
            0,
        ),
    )


def test_pairs_from_ratings_are_capped_per_prompt_and_in_total_and_counted():
    """600 ratings of one prompt (300 liked, 300 disliked) could make 90,000 pairs: capped at
    5 a prompt they make 5, by hand the diagonals (0,0), (0,1), (1,0), (0,2), (1,1), listed
    liked-first; a second prompt's 2 x 2 = 4 then meet the total cap of 7 (2 made, 2
    counted). Seen failing with the caps ignored (90,004 pairs)."""
    many = [Rating("P", f"good {i}", True) for i in range(300)]
    many += [Rating("P", f"bad {i}", False) for i in range(300)]
    second = [Rating("Q", f"yes {i}", True) for i in range(2)]
    second += [Rating("Q", f"no {i}", False) for i in range(2)]
    made, counts = pairs_from_ratings([*many, *second], whitespace_key, per_prompt=5, total=7)
    assert [(p.chosen, p.rejected) for p in made] == [
        ("good 0", "bad 0"),
        ("good 0", "bad 1"),
        ("good 0", "bad 2"),
        ("good 1", "bad 0"),
        ("good 1", "bad 1"),
        ("yes 0", "no 0"),
        ("yes 0", "no 1"),
    ]
    assert counts["capped_per_prompt"] == 90_000 - 5 and counts["capped_total"] == 2
    assert counts["pairs"] == 7


def test_chat_rows(tmp_path):
    path = write_jsonl(
        tmp_path / "chat.jsonl",
        {"messages": CHAT, "chosen": "Great film.", "rejected": "No."},
        {"messages": CHAT, "response": "Lovely.", "rating": "up", "id": 1},
        {"messages": json.dumps(CHAT), "response": "Dull.", "rating": "down", "id": 2},
    )
    pairs, ratings = load_feedback_file(path)
    assert pairs == [PreferencePair(CHAT, "Great film.", "No.")]
    assert [rating.prompt for rating in ratings] == [CHAT, CHAT]
    made, counts = pairs_from_ratings(ratings, whitespace_key)
    assert made == [PreferencePair(CHAT, "Lovely.", "Dull.", id="1|2")]
    assert counts["pairs"] == 1


def test_parquet_of_pairs_with_chats_as_json_text(tmp_path):
    path = tmp_path / "pairs.parquet"
    frame = pd.DataFrame(
        {
            "messages": [json.dumps(CHAT), json.dumps(CHAT)],
            "chosen": ["a", "b"],
            "rejected": ["c", ""],
            "id": ["p1", "p2"],
        }
    )
    frame.to_parquet(path)
    pairs, ratings = load_feedback_file(path)
    assert ratings == []
    assert pairs == [
        PreferencePair(CHAT, "a", "c", id="p1"),
        PreferencePair(CHAT, "b", "", id="p2"),
    ]


def test_parquet_of_ratings_with_chats_as_lists(tmp_path):
    path = tmp_path / "ratings.parquet"
    frame = pd.DataFrame(
        {
            "messages": [CHAT, CHAT, CHAT],
            "response": ["yes", "no", "meh"],
            "rating": [1, -1, 0],
            "source": ["app", "app", "app"],
        }
    )
    frame.to_parquet(path)
    pairs, ratings = load_feedback_file(path)
    assert pairs == []
    assert ratings == [
        Rating(CHAT, "yes", True, source="app"),
        Rating(CHAT, "no", False, source="app"),
        Rating(CHAT, "meh", None, source="app"),
    ]


def test_parquet_mixing_both_kinds(tmp_path):
    """pandas writes the other kind's columns as nulls (an absent field), integer ids with a
    missing one as floats (read back as the integer), and a filtered frame's index as a column
    of its own (not feedback, left out)."""
    path = tmp_path / "mixed.parquet"
    frame = pd.DataFrame(
        {
            "prompt": ["Q", "R", "S"],
            "chosen": ["a", None, None],
            "rejected": ["b", None, None],
            "response": [None, "c", "d"],
            "rating": [None, "thumbs_up", "down"],
            "id": [5, None, 6],
        }
    ).iloc[[2, 0, 1]]
    frame.to_parquet(path)
    assert "__index_level_0__" in pq.ParquetFile(path).schema_arrow.names
    pairs, ratings = load_feedback_file(path)
    assert pairs == [PreferencePair("Q", "a", "b", id="5")]
    assert ratings == [Rating("S", "d", False, id="6"), Rating("R", "c", True)]


def test_parquet_bool_ratings(tmp_path):
    path = tmp_path / "bools.parquet"
    pd.DataFrame(
        {"prompt": ["Q", "Q"], "response": ["a", "b"], "rating": [True, False]}
    ).to_parquet(path)
    assert [rating.liked for rating in load_feedback_file(path)[1]] == [True, False]


BAD_LINES = [
    (
        {"prompt": "Q", "chosen": 3, "rejected": "b"},
        "'chosen' must be a string, got int",
    ),
    (
        {"prompt": "Q", "chosen": "a", "rejected": ["b"]},
        "'rejected' must be a string, got list",
    ),
    (
        {"prompt": 1, "response": "a", "rating": 1},
        "'prompt' must be a string, got int",
    ),
    (
        {"prompt": "Q", "response": "a", "rating": 1, "source": 2},
        "'source' must be a string, got int",
    ),
    (
        {"prompt": "Q", "response": "a", "rating": 1, "id": 1.5},
        "'id' must be a string or an integer, got float",
    ),
    (
        {"prompt": "Q", "response": "a", "rating": 1, "id": True},
        "'id' must be a string or an integer, got bool",
    ),
    (
        {"prompt": "Q", "chosen": "a", "rejected": "b", "response": "c", "rating": 1},
        "has both a pair's fields (chosen, rejected) and a rating's (response, rating); "
        "a row is one or the other",
    ),
    (
        {"prompt": "Q", "chosen": "a", "rating": 1},
        "has both a pair's fields (chosen) and a rating's (rating); a row is one or the other",
    ),
    (
        {"prompt": "Q", "id": "1"},
        "neither a pair (chosen and rejected) nor a rating (response and rating)",
    ),
    (
        {"prompt": "Q", "chosen": "a"},
        "a pair row with 'chosen' but no 'rejected' (missing or null)",
    ),
    (
        {"prompt": "Q", "response": "a", "rating": None},
        "a rating row with 'response' but no 'rating' (missing or null)",
    ),
    (
        {"prompt": "Q", "messages": CHAT, "chosen": "a", "rejected": "b"},
        "has both 'prompt' and 'messages'; a row's prompt is one or the other",
    ),
    (
        {"chosen": "a", "rejected": "b"},
        "no prompt: a row needs 'prompt' (text) or 'messages' (a list of turns)",
    ),
    (
        {"messages": [{"role": "system", "content": "x"}], "chosen": "a", "rejected": "b"},
        "'messages' has no user turn",
    ),
    (
        {"prompt": "Q", "choosen": "a", "rejected": "b"},
        f"unknown field 'choosen'; {FIELDS_HELP}",
    ),
    (
        {"prompt": "Q", "chosen": "a", "rejected": "b", "sorce": None, "ID": 1},
        f"unknown fields 'sorce', 'ID'; {FIELDS_HELP}",
    ),
    (
        {"prompt": "Q", "response": "a", "rating": "meh"},
        f"'rating' is the unknown word 'meh'; {RATING_HELP}",
    ),
    (
        {"prompt": "Q", "response": "a", "rating": [1]},
        f"'rating' must be a number, a bool or a word, got list; {RATING_HELP}",
    ),
    # Python's json reads these non-standard literals as floats
    (
        '{"prompt": "Q", "response": "a", "rating": NaN}',
        f"'rating' is nan, not a finite number; {RATING_HELP}",
    ),
    (
        '{"prompt": "Q", "response": "a", "rating": -Infinity}',
        f"'rating' is -inf, not a finite number; {RATING_HELP}",
    ),
    (
        '{"prompt": "Q", "chosen": "a", "chosen": "b", "rejected": "c"}',
        "the key 'chosen' appears twice in one object",
    ),
    (
        '{"prompt": "Q", "response": "\\ud800", "rating": 1}',
        "'response' holds a lone UTF-16 surrogate, which is not text",
    ),
    ('{"prompt": "Q", ', "not valid JSON (Expecting property name enclosed in double quotes)"),
    ('["Q", "a", "b"]', "expected a JSON object, got list"),
]


@pytest.mark.parametrize(("bad", "problem"), BAD_LINES)
def test_a_malformed_row_is_one_line_naming_file_line_and_field(tmp_path, bad, problem):
    """The whole message: the file, the line (counted from 1, the blank line included), and
    the field and what is wrong with it."""
    good = {"prompt": "Q", "chosen": "a", "rejected": "b"}
    path = write_jsonl(tmp_path / "a.jsonl", good, "", bad)
    with pytest.raises(FeedbackFileError) as info:
        load_feedback_file(path)
    assert str(info.value) == f"{path} line 3: {problem}"
    assert isinstance(info.value, PromptFileError)  # reported as any bad prompt file is


def test_a_malformed_parquet_row_is_named_by_its_row(tmp_path):
    """Written with pyarrow, which keeps a NaN a NaN (pandas writes it as a null)."""
    path = tmp_path / "a.parquet"
    ratings = {"prompt": ["Q", "R"], "response": ["a", "b"], "rating": [1.0, float("nan")]}
    pq.write_table(pa.table(ratings), path)
    with pytest.raises(FeedbackFileError) as info:
        load_feedback_file(path)
    assert str(info.value) == f"{path} row 1: 'rating' is nan, not a finite number; {RATING_HELP}"

    pq.write_table(pa.table({"prompt": ["Q"], "chosen": [1], "rejected": ["b"]}), path)
    with pytest.raises(FeedbackFileError) as info:
        load_feedback_file(path)
    assert str(info.value) == f"{path} row 0: 'chosen' must be a string, got int"

    pq.write_table(pa.table({"prompt": ["Q"], "id": [2.5], "response": ["a"], "rating": [1]}), path)
    with pytest.raises(FeedbackFileError) as info:
        load_feedback_file(path)
    assert str(info.value) == f"{path} row 0: 'id' must be a string or an integer, got float"

    pq.write_table(pa.table({"prompt": ["Q"], "messages": [json.dumps(CHAT)]}), path)
    with pytest.raises(FeedbackFileError) as info:
        load_feedback_file(path)
    assert "row 0: has both 'prompt' and 'messages'" in str(info.value)


def test_an_unknown_parquet_column_is_named(tmp_path):
    path = tmp_path / "a.parquet"
    pd.DataFrame({"prompt": ["Q"], "choosen": ["a"], "rejected": ["b"]}).to_parquet(path)
    with pytest.raises(FeedbackFileError) as info:
        load_feedback_file(path)
    assert str(info.value) == f"{path}: unknown column 'choosen'; {FIELDS_HELP}"


def test_missing_unknown_and_unreadable_files(tmp_path):
    with pytest.raises(FeedbackFileError, match="does not exist"):
        load_feedback_file(tmp_path / "none.jsonl")
    (tmp_path / "a.csv").write_text("prompt,chosen\n")
    with pytest.raises(FeedbackFileError, match=r"unknown feedback file type '\.csv'"):
        load_feedback_file(tmp_path / "a.csv")
    (tmp_path / "b.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(FeedbackFileError, match="not a readable parquet file"):
        load_feedback_file(tmp_path / "b.parquet")
    os.mkfifo(tmp_path / "c.jsonl")
    with pytest.raises(FeedbackFileError, match="is a FIFO, not a feedback file"):
        load_feedback_file(tmp_path / "c.jsonl")
    (tmp_path / "d.jsonl").write_text("\n\n")
    assert load_feedback_file(tmp_path / "d.jsonl") == ([], [])


def test_caps_refuse_a_jsonl_file_before_reading_it(tmp_path):
    row = {"prompt": "Q", "chosen": "a", "rejected": "b"}
    path = write_jsonl(tmp_path / "a.jsonl", row, row, row)
    size = path.stat().st_size
    with pytest.raises(FeedbackFileError) as info:
        load_feedback_file(path, max_bytes=size - 1)
    assert str(info.value) == (
        f"{path}: {size} bytes, more than the limit of {size - 1} bytes a file; split the file "
        "or raise the limit"
    )
    with pytest.raises(FeedbackFileError) as info:
        load_feedback_file(path, max_rows=2)
    assert str(info.value) == (
        f"{path} line 3: more than the limit of 2 rows a file; split the file or raise the limit"
    )
    assert len(load_feedback_file(path, max_rows=3, max_bytes=size)[0]) == 3


def test_caps_refuse_a_parquet_file_by_its_metadata(tmp_path):
    path = tmp_path / "a.parquet"
    pd.DataFrame({"prompt": ["Q"] * 3, "chosen": ["a"] * 3, "rejected": ["b"] * 3}).to_parquet(path)
    with pytest.raises(FeedbackFileError, match=r"3 rows, more than the limit of 2 rows a file"):
        load_feedback_file(path, max_rows=2)
    with pytest.raises(FeedbackFileError, match="bytes uncompressed, more than the limit of 10 "):
        load_feedback_file(path, max_bytes=10)


@pytest.mark.parametrize("nested", [False, True])
def test_caps_measure_repeated_text_without_building_it(tmp_path, nested):
    """A small file can hold one long string many times (a dictionary page and an index a
    row): its metadata is under the cap, its text is not, top-level or inside a chat."""
    rows, long = 200, "x" * 10_000
    prompt = (
        {"messages": [[{"role": "user", "content": long}]] * rows}
        if nested
        else {"prompt": [long] * rows}
    )
    table = pa.table({**prompt, "chosen": ["a"] * rows, "rejected": ["b"] * rows})
    path = tmp_path / "a.parquet"
    pq.write_table(table, path)
    cap = 1_000_000  # the text is 2 MB
    assert parquet_size(path, "prompt")[1] < cap
    with pytest.raises(FeedbackFileError, match=r"its values are at least \d+ bytes, more than"):
        load_feedback_file(path, max_bytes=cap)
    assert len(load_feedback_file(path, max_bytes=3_000_000)[0]) == rows


def test_feedback_sources(tmp_path):
    folder = tmp_path / "feedback"
    assert feedback_sources(folder) == []  # a missing folder holds no feedback
    folder.mkdir()
    for name in ("b.parquet", "a.jsonl", "README.md", ".gitkeep", "notes.json"):
        (folder / name).write_text("")
    elsewhere = tmp_path / "stored.jsonl"
    elsewhere.write_text("")
    (folder / "c.jsonl").symlink_to(elsewhere)  # as DVC's symlink cache makes it
    assert feedback_sources(folder) == [folder / n for n in ("a.jsonl", "b.parquet", "c.jsonl")]

    os.mkfifo(folder / "d.jsonl")
    with pytest.raises(FeedbackFileError) as info:
        feedback_sources(folder)
    assert str(info.value) == (
        f"{folder / 'd.jsonl'} is a FIFO, not a feedback file; feedback files are regular "
        "files (or links to them)"
    )
    (folder / "d.jsonl").unlink()
    (folder / "e.parquet").symlink_to(tmp_path / "gone.parquet")
    with pytest.raises(FeedbackFileError, match="is a link to nothing"):
        feedback_sources(folder)
    (folder / "e.parquet").unlink()
    (folder / "f.jsonl").mkdir()
    with pytest.raises(FeedbackFileError, match="is a folder, not a feedback file"):
        feedback_sources(folder)


def test_a_parquet_feedback_value_is_bounded_as_a_jsonl_line_is(tmp_path):
    """A Parquet file of a few kB can hold a reply of megabytes (repeated text compresses to
    nothing); each value is bounded as a JSONL feedback line is. Seen failing before the bound
    (the 2 MiB reply was accepted)."""
    from ppo_core.prompts import MAX_LINE_BYTES

    path = tmp_path / "ratings.parquet"
    reply = "great " * (2 * MAX_LINE_BYTES // 6)
    table = pa.table({"prompt": ["A film?"], "response": [reply], "rating": [1]})
    pq.write_table(table, path, compression="zstd")
    assert path.stat().st_size < 20_000
    with pytest.raises(FeedbackFileError, match=r"row 0: 'response' is \d+ characters long"):
        load_feedback_file(path)
