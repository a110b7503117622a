"""Chat-formatted prompts: ``messages`` rows read and checked, rendered by the policy's chat
template with the generation prompt (one BOS), counted as rendered by validation, trained on and
evaluated; rewards receive the turns; a tokenizer without a template is refused by folder."""

from __future__ import annotations

import json
import warnings

import pandas as pd
import pytest
import torch

from ppo_core.config import load_config
from ppo_core.models.causal_lm import load_tokenizer
from ppo_core.models.generation import (
    ChatTemplateError,
    check_chat_template,
    encode_prompts,
    prompt_token_ids,
)
from ppo_core.prompts import PromptFileError, chat_json, load_prompts, prompt_text
from ppo_core.rewards.loading import build_reward_fn
from ppo_core.rewards.scorers import SentimentScorer
from tests.helpers import CHAT_TEMPLATE, build_tiny_causal_lm

CHAT = [
    {"role": "system", "content": "You review films."},
    {"role": "user", "content": "Tell me about the movie."},
]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny Qwen2-style model whose tokenizer has a ChatML template that writes its own BOS."""
    folder = tmp_path_factory.mktemp("chat") / "qwen2"
    return build_tiny_causal_lm(folder, "qwen2", chat_template=CHAT_TEMPLATE)


def quiet_tokenizer(folder):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_tokenizer(folder)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# -- reading ------------------------------------------------------------------------------------


def test_jsonl_and_parquet_chats_read_as_their_turns(tmp_path):
    jsonl = write_jsonl(tmp_path / "p.jsonl", [{"messages": CHAT}, {"prompt": "The film"}])
    assert load_prompts(jsonl) == [CHAT, "The film"]
    parquet = tmp_path / "p.parquet"
    pd.DataFrame({"messages": [chat_json(CHAT)]}).to_parquet(parquet)
    assert load_prompts(parquet) == [CHAT]
    assert prompt_text(CHAT) == "system: You review films.\nuser: Tell me about the movie."


@pytest.mark.parametrize(
    ("messages", "problem"),
    [
        ([{"role": "wizard", "content": "hi"}], r"messages\[0\] has the unknown role 'wizard'"),
        ([{"role": "system", "content": "Be brief."}], "'messages' has no user turn"),
        ([], "must be a non-empty list"),
        ("not a list", "not the JSON of a list of turns"),
        ([{"role": "user", "content": 3}], r"messages\[0\].content is int, not text"),
        ([{"role": "user", "text": "hi"}], r"messages\[0\] must be an object with exactly"),
        ([{"role": "user", "content": "  "}], "every turn of 'messages' is blank"),
    ],
)
def test_a_bad_messages_row_names_the_file_line_and_turn(tmp_path, messages, problem):
    path = write_jsonl(tmp_path / "p.jsonl", [{"messages": CHAT}, {"messages": messages}])
    with pytest.raises(PromptFileError, match=rf"p\.jsonl:2: .*{problem}"):
        load_prompts(path)


def test_a_parquet_chat_column_must_be_json_text(tmp_path):
    path = tmp_path / "p.parquet"
    pd.DataFrame({"messages": [chat_json(CHAT), "[{"]}).to_parquet(path)
    with pytest.raises(PromptFileError, match="row 1: 'messages' is text that is not the JSON"):
        load_prompts(path)


# -- rendering ----------------------------------------------------------------------------------


def test_a_chat_is_rendered_with_the_generation_prompt_and_one_bos(chat_model):
    tokenizer = quiet_tokenizer(chat_model)
    chat_ids, plain_ids = prompt_token_ids(tokenizer, [CHAT, "The movie was"])
    text = tokenizer.decode(chat_ids)
    assert text.startswith(tokenizer.bos_token + "<|im_start|>system\nYou review films.")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert chat_ids.count(tokenizer.bos_token_id) == 1  # the template's; none added on top
    # a plain prompt is tokenised as before, with the tokenizer's own BOS
    assert plain_ids == tokenizer("The movie was")["input_ids"]
    assert plain_ids[0] == tokenizer.bos_token_id

    ids, mask = encode_prompts(tokenizer, [CHAT, "The movie was"])
    for row, expected in enumerate((chat_ids, plain_ids)):
        assert ids[row][mask[row].bool()].tolist() == expected
        assert mask[row, : ids.shape[1] - len(expected)].sum() == 0  # padded on the left


def test_a_tokenizer_without_a_chat_template_is_refused_naming_its_folder(tiny_model_dir):
    tokenizer = quiet_tokenizer(tiny_model_dir)
    check_chat_template(tokenizer, ["plain text needs no template"], tiny_model_dir, "x")
    with pytest.raises(ChatTemplateError, match=rf"model.policy '{tiny_model_dir}'.*chat template"):
        check_chat_template(tokenizer, ["a", CHAT], tiny_model_dir, "model.policy")


# -- rewards ------------------------------------------------------------------------------------


def test_the_builtin_scores_the_assistant_turn_after_a_chat():
    scorer = SentimentScorer()
    scores = scorer([CHAT, "Awful."], [" A wonderful, great film.", " A wonderful, great film."])
    alone = scorer([""], [" A wonderful, great film."])
    assert scores[0] == alone[0]  # the chat's text does not enter
    assert scores[1] != scores[0]


def test_a_reward_model_renders_the_chat_with_its_own_template(chat_model):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(chat_model)
    config.num_labels = 1
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    folder = chat_model.parent / "reward"
    model.save_pretrained(folder)
    quiet_tokenizer(chat_model).save_pretrained(folder)
    reward = build_reward_fn(str(folder))
    response = " It was fine."
    scores = reward([CHAT, "The movie was"], [response, response])

    tokenizer = quiet_tokenizer(folder)
    rendered = tokenizer.apply_chat_template(
        [*CHAT, {"role": "assistant", "content": response}], tokenize=False
    )
    expected = []
    for ids in (
        tokenizer(rendered, add_special_tokens=False)["input_ids"],
        tokenizer("The movie was" + response)["input_ids"],
    ):
        with torch.no_grad():
            expected.append(float(model.eval()(input_ids=torch.tensor([ids])).logits[0, 0]))
    assert scores.tolist() == pytest.approx(expected, abs=1e-5)


# -- the pipeline -------------------------------------------------------------------------------


def test_chat_prompts_are_prepared_validated_trained_on_and_evaluated(tmp_path, chat_model):
    """prepare keeps the turns, validate counts the rendered tokens, train and evaluate sample
    from rendered prompts, and the user's reward receives the turns."""
    from flows import stages
    from ppo_core.evaluation.evaluate import evaluate
    from ppo_core.training.loop import train

    raw = tmp_path / "raw"
    raw.mkdir()
    chats = [
        [{"role": "user", "content": f"Describe film number {i}  in a few words."}]
        for i in range(40)
    ]
    write_jsonl(raw / "chats.jsonl", [{"messages": chat} for chat in chats])
    (tmp_path / "chat_reward.py").write_text(
        "import json\n"
        "def score(prompts, responses):\n"
        "    with open('calls.jsonl', 'a') as log:\n"
        "        log.write(json.dumps(prompts) + '\\n')\n"
        "    return [float(len(r)) for r in responses]\n"
    )
    config = load_config(
        overrides=[
            f"model.policy={chat_model}",
            "model.reward=chat_reward:score",
            f"data.raw_dir={raw}",
            f"data.interim_dir={tmp_path / 'interim'}",
            f"data.prepared_dir={tmp_path / 'prepared'}",
            f"data.train_file={tmp_path / 'prepared' / 'train.parquet'}",
            f"data.eval_file={tmp_path / 'prepared' / 'eval.parquet'}",
            "data.eval_fraction=0.25",
            f"validation.report_dir={tmp_path / 'validation'}",
            "validation.min_train_rows=4",
            "validation.min_eval_rows=2",
            "validation.max_tokens=64",
            f"train.output_dir={tmp_path / 'candidate'}",
            f"train.checkpoint_dir={tmp_path / 'checkpoints'}",
            f"train.metrics_dir={tmp_path / 'metrics'}",
            f"eval.output_dir={tmp_path / 'eval'}",
            "eval.num_prompts=4",
            "eval.samples_per_prompt=1",
            "ppo.rollout_batch_size=4",
            "ppo.mini_batch_size=4",
            "ppo.micro_batch_size=2",
            "generation.max_new_tokens=4",
            "train.iterations=1",
        ]
    )
    stages.prepare(config)
    frame = pd.read_parquet(tmp_path / "interim" / "train.parquet")
    assert list(frame.columns) == ["messages"]
    # whitespace inside a turn is normalised, as for plain prompts
    assert json.loads(frame["messages"][0])[0]["content"].startswith("Describe film number")
    assert "  " not in frame["messages"][0]

    stages.validate(config)
    summary = json.loads((tmp_path / "validation" / "summary.json").read_text())
    tokenizer = quiet_tokenizer(chat_model)
    first = json.loads(frame["messages"][0])
    rendered = len(prompt_token_ids(tokenizer, [first])[0])
    assert summary["settings"]["prompt_field"] == "messages"
    assert (
        summary["splits"]["train"]["n_tokens"]["max"]
        >= rendered
        > len(tokenizer(first[0]["content"])["input_ids"])
    )

    import os

    cwd = os.getcwd()
    os.chdir(tmp_path)  # the reward module and its log live in the project folder
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            train(config)
            reports = evaluate(config, tmp_path / "candidate")
    finally:
        os.chdir(cwd)
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert all(
        isinstance(prompt, list) and prompt[0]["role"] == "user" for c in calls for prompt in c
    )
    assert reports["candidate"].samples[0]["prompt"].startswith("user: Describe film number")


def test_a_data_version_holds_one_kind_of_prompt(tmp_path):
    from flows import stages

    raw = tmp_path / "raw"
    raw.mkdir()
    write_jsonl(raw / "a.jsonl", [{"prompt": f"plain {i}"} for i in range(10)])
    write_jsonl(raw / "b.jsonl", [{"messages": CHAT}])
    config = load_config(
        overrides=[f"data.raw_dir={raw}", f"data.interim_dir={tmp_path / 'interim'}"]
    )
    with pytest.raises(PromptFileError, match=r"a\.jsonl holds plain 'prompt' rows and .*b\.jsonl"):
        stages.prepare(config)
    assert not (tmp_path / "interim").exists()
