"""Held-out evaluation: the reward the candidate was trained with scores both models unless
``eval.reward`` says otherwise, and tokenizers that differ from the KL reference's are handled
explicitly (a baseline is scored without KL, a candidate is refused)."""

from __future__ import annotations

import dataclasses
import html
import json
import re
import shutil
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ppo_core.config import load_config
from ppo_core.evaluation.evaluate import (
    EvaluationWarning,
    TokenizerMismatchError,
    evaluate,
    evaluation_reward,
)
from ppo_core.models.causal_lm import load_tokenizer
from ppo_core.models.vocabulary import reference_vocabulary, vocabulary_mismatch, vocabulary_of
from ppo_core.rewards.loading import RewardError
from tests.helpers import small_config

REWARD_MODULE = "evaluation_test_rewards"
REWARDS = """
import threading

RELEASE = threading.Event()


def seven(prompts, responses):
    return [7.0] * len(responses)


def minus_three(prompts, responses):
    return [-3.0] * len(responses)


def hang(prompts, responses):
    RELEASE.wait(60)
    return [0.0] * len(responses)
"""


def evaluation_config(tmp: Path, model: Path, prompts: tuple[Path, Path], *extra: str):
    """The trainer tests' small run, with evaluation and promotion outputs under ``tmp``."""
    return small_config(
        tmp,
        model,
        prompts,
        f"eval.output_dir={tmp / 'eval'}",
        f"promote.registry={tmp / 'registry.json'}",
        f"promote.production_dir={tmp / 'production'}",
        f"promote.report={tmp / 'promotion.json'}",
        "ppo.epochs=1",
        "train.iterations=1",
        "eval.num_prompts=4",
        "eval.samples_per_prompt=1",
        *extra,
    )


def build_other_model(folder: Path) -> Path:
    """An untrained 1-layer GPT-2 whose byte-level BPE tokenizer has about 300 tokens, far fewer
    than the tiny default's: token ids of the two tokenizers mean different text, and ids of the
    tiny default's tokenizer are out of this model's range."""
    from transformers import GPT2LMHeadModel

    from ppo_core.base_sources.review_grammar import generate_review_corpus
    from ppo_core.base_sources.tiny_default import tiny_gpt2_config, train_tokenizer

    tokenizer = train_tokenizer(generate_review_corpus(200, seed=1), vocab_size=300)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_gpt2_config(len(tokenizer), n_layer=1, n_embd=32, n_head=2))
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory) -> Path:
    return build_other_model(tmp_path_factory.mktemp("other") / "model")


@pytest.fixture
def reward_module(tmp_path, monkeypatch) -> str:
    """``evaluation_test_rewards.py`` in the working folder, importable as ``module:function``."""
    (tmp_path / f"{REWARD_MODULE}.py").write_text(REWARDS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, REWARD_MODULE, raising=False)
    return REWARD_MODULE


def read(folder: Path, name: str):
    text = (folder / name).read_text()
    return json.loads(text) if name.endswith(".json") else text


# --- the reward ----------------------------------------------------------------------------------


def test_a_candidate_trained_with_another_reward_is_scored_only_with_one_the_user_sets(
    tmp_path, tiny_model_dir, prompt_files, reward_module
):
    """Training records its reward with the candidate; evaluation never imports a reward because
    the model folder names it: another one than ``model.reward`` stops it, naming both and the
    key to set, and ``eval.reward`` (or the same ``model.reward``) scores with it."""
    from ppo_core.rewards.loading import RewardError
    from ppo_core.training.loop import train

    trained_with = f"{reward_module}:seven"
    train(evaluation_config(tmp_path, tiny_model_dir, prompt_files, f"model.reward={trained_with}"))
    candidate = tmp_path / "candidate"
    summary = read(candidate, "training_summary.json")
    assert summary["reward"] == trained_with
    assert summary["reference"] == str(tiny_model_dir)

    # As after `ppo train model.reward=...` then a plain `ppo evaluate`: model.reward is the default.
    config = evaluation_config(tmp_path, tiny_model_dir, prompt_files)
    assert config.model.reward == "builtin:sentiment"
    with pytest.raises(RewardError) as refused:
        evaluate(config, candidate, tiny_model_dir)
    assert str(refused.value).startswith(
        f"the candidate was trained with the reward '{trained_with}' (recorded in "
        f"{candidate / 'training_summary.json'}), not model.reward='builtin:sentiment'"
    )
    assert f"set eval.reward='{trained_with}'" in str(refused.value)
    out = tmp_path / "eval"
    assert not out.exists()

    # The same reward as model.reward: used, no warning.
    config = evaluation_config(
        tmp_path, tiny_model_dir, prompt_files, f"model.reward={trained_with}"
    )
    reports = evaluate(config, candidate, tiny_model_dir)
    for side in ("candidate", "baseline"):  # both scored with the one reward
        assert reports[side].metrics["score"] == 7.0
        assert "kl_to_reference" in reports[side].metrics  # same tokenizer as the reference
    assert read(out, "models.json")["reward"] == trained_with
    assert f"reward {trained_with} (model.reward)" in read(out, "report.md")

    chosen = f"{reward_module}:minus_three"
    config = evaluation_config(tmp_path, tiny_model_dir, prompt_files, f"eval.reward={chosen}")
    with pytest.warns(EvaluationWarning, match=f"the candidate was trained with '{trained_with}'"):
        reports = evaluate(config, candidate, tiny_model_dir)
    assert [reports[s].metrics["score"] for s in ("candidate", "baseline")] == [-3.0, -3.0]
    assert read(out, "models.json")["reward"] == chosen
    assert f"reward {chosen} (eval.reward)" in read(out, "report.md")


def test_a_reward_named_in_a_model_folder_is_never_imported(tmp_path, tiny_model_dir, prompt_files):
    """A candidate folder whose summary names a module inside the folder itself: evaluation stops
    before importing it."""
    from ppo_core.rewards.loading import RewardError

    candidate = tmp_path / "candidate"
    shutil.copytree(tiny_model_dir, candidate)
    marker = tmp_path / "code-ran"
    (candidate / "planted_reward.py").write_text(
        f"import os\nos.mkdir({str(marker)!r})\ndef score(p, r):\n    return [0.0] * len(r)\n"
    )
    (candidate / "training_summary.json").write_text(json.dumps({"reward": "planted_reward:score"}))
    config = evaluation_config(tmp_path, tiny_model_dir, prompt_files)
    sys.path.insert(0, str(candidate))
    try:
        with pytest.raises(RewardError, match="a model folder does not choose the code"):
            evaluate(config, candidate, tiny_model_dir)
    finally:
        sys.path.remove(str(candidate))
        sys.modules.pop("planted_reward", None)
    assert not marker.exists()


def test_a_hanging_reward_stops_evaluation_within_the_timeout(
    tmp_path, tiny_model_dir, prompt_files, reward_module
):
    from ppo_core.rewards.loading import RewardTimeoutError

    spec = f"{reward_module}:hang"
    config = evaluation_config(
        tmp_path, tiny_model_dir, prompt_files, f"eval.reward={spec}", "model.reward_timeout=1"
    )
    try:
        with pytest.raises(RewardTimeoutError, match=rf"'{spec}' did not return within 1 s"):
            evaluate(config, tiny_model_dir)
    finally:
        sys.modules[reward_module].RELEASE.set()
    assert not (tmp_path / "eval").exists()


def test_the_reward_choice_without_a_record(tmp_path, tiny_model_dir, prompt_files):
    config = evaluation_config(tmp_path, tiny_model_dir, prompt_files)
    plain = tmp_path / "plain"
    plain.mkdir()
    assert evaluation_reward(config, plain).spec == "builtin:sentiment"
    assert evaluation_reward(config, plain).source == "model.reward"
    # A candidate saved before training_summary.json named its reward: its ppo_config.yaml does.
    (plain / "ppo_config.yaml").write_text("model:\n  reward: my_rewards:score\n")
    with pytest.raises(RewardError, match="'my_rewards:score' .*ppo_config.yaml"):
        evaluation_reward(config, plain)


# --- tokenizers ----------------------------------------------------------------------------------


def test_vocabulary_comparison(tmp_path, tiny_model_dir, other_model_dir):

    same = vocabulary_of(tiny_model_dir, load_tokenizer(tiny_model_dir))
    assert (
        vocabulary_mismatch(same, vocabulary_of(tiny_model_dir, load_tokenizer(tiny_model_dir)))
        is None
    )
    other = vocabulary_of(other_model_dir, load_tokenizer(other_model_dir))
    assert "vocabularies differ" in str(vocabulary_mismatch(same, other))

    added = load_tokenizer(tiny_model_dir)
    added.add_tokens(["<|extra|>"])
    assert "vocabularies differ" in str(vocabulary_mismatch(same, vocabulary_of("x", added)))
    moved_eos = load_tokenizer(tiny_model_dir)
    moved_eos.eos_token = "<|unk|>"
    assert "eos token id 2 and 3" in str(vocabulary_mismatch(same, vocabulary_of("x", moved_eos)))
    resized = dataclasses.replace(same, model_vocab_size=2048)
    assert f"vocab_size {same.model_vocab_size} and 2048" in str(vocabulary_mismatch(same, resized))
    assert vocabulary_mismatch(same, dataclasses.replace(same, model_type="llama")) is None

    # A reference folder without tokenizer files is read with model.policy's tokenizer.
    bare = tmp_path / "bare_reference"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy2(tiny_model_dir / name, bare / name)
    policy = str(other_model_dir)
    assert reference_vocabulary(policy, str(bare)).digest == (other.digest)


@pytest.fixture(scope="module")
def other_baseline_run(tmp_path_factory, tiny_model_dir, prompt_files, other_model_dir):
    """An evaluation against a baseline with another tokenizer than the reference."""
    tmp = tmp_path_factory.mktemp("other_baseline")
    shutil.copytree(tiny_model_dir, tmp / "candidate")
    config = evaluation_config(
        tmp,
        tiny_model_dir,
        prompt_files,
        "promote.min_improvement=-10.0",
        "promote.max_kl=100.0",
        "promote.min_eos_rate=0.0",
    )
    with pytest.warns(EvaluationWarning, match="another tokenizer than the KL reference") as seen:
        reports = evaluate(config, tmp / "candidate", other_model_dir)
    return config, reports, [str(w.message) for w in seen]


def test_a_baseline_with_another_tokenizer_is_scored_without_kl(
    other_baseline_run, tiny_model_dir, other_model_dir
):
    config, reports, warned = other_baseline_run
    [message] = [m for m in warned if "another tokenizer" in m]
    assert str(other_model_dir) in message and str(tiny_model_dir) in message
    assert "its KL to the reference is not measured" in message
    baseline = reports["baseline"]
    assert "kl_to_reference" not in baseline.metrics
    assert baseline.metrics["num_samples"] == 4.0 and "score" in baseline.metrics
    assert "kl_to_reference" in reports["candidate"].metrics
    out = Path(config.eval.output_dir)
    metrics = read(out, "metrics.json")
    assert "baseline/kl_to_reference" not in metrics and "baseline/score" in metrics
    assert "candidate/kl_to_reference" in metrics and "delta/score" in metrics
    report = read(out, "report.md")
    assert "| kl_to_reference | " in report
    assert "n/a (other tokenizer than the reference)" in report
    assert read(out, "models.json")["baseline"] == str(other_model_dir)


def test_promote_decides_on_a_baseline_without_kl(other_baseline_run):
    from flows import stages

    config, _, _ = other_baseline_run
    # the fluency guard reads the baseline's reference NLL, which another tokenizer cannot have:
    # the gate cannot judge it, refuses, and names the key that turns the guard off
    entry = stages.promote(config)
    assert entry["decision"] == "rejected"
    [failed] = [r for r in entry["reasons"] if r.startswith("FAIL")]
    assert "baseline reference_nll is missing" in failed and "promote.max_nll_increase" in failed
    config.promote.max_nll_increase = None
    entry = stages.promote(config)
    assert entry["decision"] == "promoted" and entry["version"] == "v0001"
    assert "kl_to_reference" not in entry["baseline_metrics"]
    assert any(r.startswith("pass: score") and "vs baseline" in r for r in entry["reasons"])
    assert any(r.startswith("pass: KL to reference") for r in entry["reasons"])
    assert entry["reward"] == "builtin:sentiment"
    assert (Path(config.promote.production_dir) / "v0001" / "config.json").is_file()


def test_a_candidate_with_another_tokenizer_than_the_reference_is_refused(
    tmp_path, tiny_model_dir, prompt_files, other_model_dir
):
    config = evaluation_config(tmp_path, tiny_model_dir, prompt_files)
    with pytest.raises(TokenizerMismatchError) as refused:
        evaluate(config, other_model_dir, tiny_model_dir)
    message = str(refused.value)
    assert str(other_model_dir) in message and str(tiny_model_dir) in message
    assert "named by model.policy" in message and "vocabularies differ" in message
    assert not (tmp_path / "eval").exists()

    # The command line says so in one line, with exit code 2.
    from flows.cli import app

    result = CliRunner().invoke(
        app,
        [
            "evaluate",
            "--candidate",
            str(other_model_dir),
            "--baseline",
            "",
            *(
                f"{k}={v}"
                for k, v in small_overrides(tmp_path, tiny_model_dir, prompt_files).items()
            ),
        ],
    )
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "another tokenizer than the KL reference" in result.output
    assert not (tmp_path / "eval").exists()


# --- the guards against a gamed reward -----------------------------------------------------------


def build_repeating_model(base: Path, folder: Path, word: str = " great") -> Path:
    """``base`` changed to say ``word`` at every step: its final layer norm outputs ones whatever
    the input, and an untied output layer maps ones to a logit of 40 for ``word``'s token and 0
    for every other, so each response is ``word`` repeated up to the token budget. It games a
    sentiment lexicon the way a policy that learnt to repeat one positive word would."""
    from transformers import GPT2LMHeadModel

    tokenizer = load_tokenizer(base, False)
    [token] = tokenizer(word, add_special_tokens=False).input_ids
    model = GPT2LMHeadModel.from_pretrained(base)
    width = model.config.n_embd
    model.config.tie_word_embeddings = False
    model.lm_head = torch.nn.Linear(width, model.config.vocab_size, bias=False)
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.weight[token] = 40.0 / width
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.fill_(1.0)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_candidate_that_repeats_a_positive_word_gains_score_but_the_guards_refuse_it(
    tmp_path, tiny_model_dir, prompt_files
):
    from flows import stages

    candidate = build_repeating_model(tiny_model_dir, tmp_path / "candidate")  # train.output_dir
    gate_keys = [
        "promote.max_kl=1000.0",
        "promote.max_kl_from_origin=1000.0",
        "promote.min_eos_rate=0.0",
    ]
    config = evaluation_config(
        tmp_path,
        tiny_model_dir,
        prompt_files,
        "eval.num_prompts=8",
        "promote.check_reward=builtin:afinn",
        *gate_keys,
    )
    reports = evaluate(config, candidate, tiny_model_dir)
    gamed, base = reports["candidate"].metrics, reports["baseline"].metrics
    assert {s["response"] for s in reports["candidate"].samples} == {" great" * 6}
    # measured: score 0.979 vs 0.028 and AFINN's check score 0.999 vs -0.020 (both lexicons are
    # gamed); distinct-2 0.025 vs 1.0; the reference's NLL 7.51 vs 3.01 nats per token
    assert gamed["score"] > base["score"] + 0.5 and gamed["check_score"] > base["check_score"]
    assert gamed["distinct_2"] < 0.05 and base["distinct_2"] > 0.5
    # 4.50 apart measured (4.90 with earlier builds' baseline responses); NLL averaged over the
    # prompt's tokens too would be 3.29 apart
    assert gamed["reference_nll"] > base["reference_nll"] + 4.0
    metrics = read(tmp_path / "eval", "metrics.json")
    assert {"candidate/check_score", "baseline/reference_nll"} <= set(metrics)
    assert read(tmp_path / "eval", "models.json")["check_reward"] == "builtin:afinn"
    assert "| check_score | " in read(tmp_path / "eval", "report.md")

    entry = stages.promote(config)
    assert entry["decision"] == "rejected" and "version" not in entry
    verdicts = [r.split(" ")[0] + " " + r.split(" ")[1] for r in entry["reasons"]]
    # the independent lexicon is gamed as well; repetition and fluency are what give it away
    assert verdicts == [
        "pass: score",
        "pass: KL",
        "pass: KL",
        "pass: EOS",
        "FAIL: distinct-2",
        "FAIL: reference",
        "pass: check",
    ]
    assert read(tmp_path, "promotion.json")["reasons"] == entry["reasons"]

    # with the guards off the same candidate is promoted: they are what refused it
    unguarded = evaluation_config(
        tmp_path,
        tiny_model_dir,
        prompt_files,
        "promote.max_distinct_2_drop=null",
        "promote.max_nll_increase=null",
        *gate_keys,
    )
    assert stages.promote(unguarded)["decision"] == "promoted"


def small_overrides(tmp: Path, model: Path, prompts: tuple[Path, Path]) -> dict[str, object]:
    return {
        "model.policy": model,
        "data.eval_file": prompts[1],
        "eval.output_dir": tmp / "eval",
        "promote.registry": tmp / "registry.json",
        "promote.production_dir": tmp / "production",
    }


# --- the Markdown report is inert to the text it quotes ------------------------------------------

HOSTILE = [
    "<script>alert(1)</script> after",
    "[click me](javascript:alert(1)) and ![pic](http://x.test/p.png)",
    "a | b | c |",
    "`code` and ``more`` and ~~struck~~ and ~~~",
    "*em* _em_ **strong** __strong__ a*b*c",
    "line one\n# heading\n- item\n> quote\r\n\n    indented code\rlast",
    "<!-- comment --> <img src=x onerror=alert(1)> <div>block</div>",
    "# heading at the start",
    "- a list at the start",
    "+ another list",
    "12. an ordered list",
    "> a quote at the start",
    "     five spaces first",
    "&lt;script&gt; &#60;b&#62; &amp; entities",
    "<https://evil.test/x> https://evil.test/y www.evil.test me@evil.test",
    "[ref]: javascript:alert(1)\n[ref]",
    "ends with a backslash \\",
    "\\| an escaped pipe \\\\ and \\* star",
    "{braces} and [^1] footnote and ---",
    "snake_case_name and _leading and trailing_",
]


def hostile_reports():
    from ppo_core.evaluation.evaluate import ModelReport

    def samples(offset):
        return [
            {"prompt": HOSTILE[i], "response": HOSTILE[-1 - i], "score": 0.5 - i / 10}
            for i in range(offset, len(HOSTILE), 2)
        ]

    return {
        "candidate": ModelReport(
            "candidate", "/tmp/a|b/<script>x</script>/[x](javascript:y)", {"score": 0.5}, samples(0)
        ),
        "baseline": ModelReport(
            "baseline",
            "models/`base`\n# x",
            {"score": 0.25},
            samples(1),
            unmeasured={"kl_to_reference": "other tokenizer than the reference"},
        ),
    }


def hostile_report() -> str:
    from ppo_core.evaluation.report import RewardChoice, markdown_report

    return markdown_report(
        hostile_reports(),
        len(HOSTILE),
        load_config(),
        reward=RewardChoice(
            "evil_module:score|<script>x</script>",
            "recorded with the candidate in /tmp/[x](javascript:y)/training_summary.json",
        ),
        reference="/models/<b>ref</b>|x",
    )


class _Rendered(HTMLParser):
    """Tags of rendered HTML, and the text of each list item (a ``<br>`` read as a newline)."""

    def __init__(self, rendered_html: str):
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict]] = []
        self.items: list[str] = []
        self.rows: list[int] = []
        self._item: list[str] | None = None
        self.feed(rendered_html)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag == "li":
            self._item = []
        elif tag == "tr":
            self.rows.append(0)
        elif tag in ("td", "th"):
            self.rows[-1] += 1
        elif tag == "br" and self._item is not None:
            self._item.append("\n")

    def handle_endtag(self, tag):
        if tag == "li" and self._item is not None:
            self.items.append("".join(self._item))
            self._item = None

    def handle_data(self, data):
        if self._item is not None:
            self._item.append(data)

    def handle_comment(self, data):
        self.tags.append(("!--", {}))


def _render_commonmark(text: str) -> str:
    markdown_it = pytest.importorskip("markdown_it")
    return markdown_it.MarkdownIt("commonmark").enable(["table", "strikethrough"]).render(text)


def _render_python_markdown(text: str) -> str:
    markdown = pytest.importorskip("markdown")
    return markdown.markdown(text, extensions=["tables"])


def test_escape_markdown_keeps_plain_text_plain():
    from ppo_core.evaluation.markdown import escape_markdown

    assert escape_markdown("a plain review of the film") == "a plain review of the film"
    assert escape_markdown("models/base_v2/my_module:score") == "models/base_v2/my_module:score"
    assert escape_markdown("<b>") == "&lt;b&gt;"
    assert escape_markdown("one\ntwo\r\nthree") == "one<br>two<br>three"
    assert escape_markdown("a | b") == "a \\| b"


def test_the_report_text_has_no_raw_markup_from_prompts_responses_paths_or_reward():
    report = hostile_report()
    lowered = report.lower()
    for raw in ("<script", "<img", "<div", "<!--", "](", "<https", "``", "~~", "<b>"):
        assert raw not in lowered, raw
    # one line per sample: a newline in a prompt or response never starts a block of its own
    listed = [line for line in report.splitlines() if line.startswith("- ")]
    assert len(listed) == len(HOSTILE)
    # the table keeps its columns: every row has the header's cell count (unescaped pipes)
    table = [line for line in report.splitlines() if line.startswith("|")]
    cells = {len(re.split(r"(?<!\\)\|", line)) for line in table}
    assert len(cells) == 1


@pytest.mark.parametrize("render", [_render_commonmark, _render_python_markdown])
def test_the_rendered_report_shows_hostile_text_as_text(render):
    rendered_html = render(hostile_report())
    rendered = _Rendered(rendered_html)
    tags = [tag for tag, _ in rendered.tags]
    for forbidden in ("script", "img", "a", "div", "!--", "code", "pre", "blockquote", "s", "del"):
        assert forbidden not in tags, (forbidden, rendered_html)
    assert tags.count("h1") == 1 and tags.count("h2") == 2  # "Evaluation", one per model
    assert tags.count("ul") == 2 and tags.count("ol") == 0  # one flat list of samples per model
    assert tags.count("em") == 0
    assert tags.count("strong") == len(HOSTILE)  # the report's own bold responses only
    allowed = {"h1", "h2", "p", "table", "thead", "tbody", "tr", "th", "td", "ul", "li", "strong"}
    assert set(tags) <= allowed | {"br"}
    assert len(rendered.rows) == 3 and len(set(rendered.rows)) == 1  # header + 2 metrics, 3 cells
    # Nothing was lost: each list item reads as the prompt and response as given.
    reports = hostile_reports()
    expected = [
        f"{_as_shown(s['prompt'])} → {_as_shown(s['response'])} ({s['score']:+.3f})"
        for name in ("candidate", "baseline")
        for s in reports[name].samples
    ]
    assert rendered.items == expected
    text = html.unescape(re.sub(r"<[^>]+>", "", rendered_html))
    for path in (reports["candidate"].path, "evil_module:score|<script>x</script>"):
        assert path in text


def _as_shown(text: str) -> str:
    """How a prompt or response reads in the report: trimmed, each line break a ``<br>``."""
    return text.strip().replace("\r\n", "\n").replace("\r", "\n")


def test_fluency_is_judged_at_temperature_1_whatever_the_sampling_temperature():
    """_drift_from: the KL compares logprobs at the sampling temperature, the reference's NLL
    reads them at temperature 1. Each stand-in logprob is minus the temperature it was asked
    at, so the numbers say which temperature each used."""
    from ppo_core.evaluation.evaluate import _drift_from

    asked = []

    def logprobs_of(scorer, temperature):
        asked.append(temperature)
        return torch.full((1, 2), -temperature)

    own, mask = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool)
    kl, nll = _drift_from(None, own, mask, logprobs_of, 0.5)
    assert asked == [0.5, 1.0]
    assert kl == pytest.approx(1.0)  # sum over 2 tokens of 0 - (-0.5)
    assert nll == pytest.approx(1.0)  # -mean of -1.0, not of -0.5
    asked.clear()
    assert _drift_from(None, own, mask, logprobs_of, 1.0) == (pytest.approx(2.0), 1.0)
    assert asked == [1.0]  # at temperature 1, one pass serves both


def test_the_evaluation_seed_alone_decides_the_samples(tmp_path, tiny_model_dir, prompt_files):
    """Evaluating one folder twice with another run seed (`seed`) gives the same samples; another
    eval.seed gives others."""

    def samples(*extra):
        folder = tmp_path / "-".join(extra)
        config = evaluation_config(folder, tiny_model_dir, prompt_files, *extra)
        evaluate(config, tiny_model_dir)
        return read(folder / "eval", "samples.json")["candidate"]

    first = samples("seed=0", "eval.seed=1234")
    assert samples("seed=7", "eval.seed=1234") == first
    assert samples("seed=0", "eval.seed=99") != first


def test_task_metrics_by_hand_with_accuracy_by_task():
    """Two prompts, two replies each: chain_sum [1, 0] and [1, 1], word_sorting's [0.2, 0].
    Accuracy 3/6; pass@1 = mean(1/2, 1, 0) = 0.5; pass@2 = mean(1, 1, 0) = 2/3; by task
    chain_sum 3/4 and word sorting 0 (its 0.2 is partial, not correct; "Word Sorting" named
    as a metric)."""
    import torch

    from ppo_core.evaluation.task import task_metrics

    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.2, 0.0])
    tasks = ["chain_sum"] * 4 + ["Word Sorting"] * 2
    metrics = task_metrics(scores, 2, reward_fn=None, tasks=tasks)
    assert metrics["accuracy"] == pytest.approx(0.5)
    assert metrics["pass_at_1"] == pytest.approx(0.5)
    assert metrics["pass_at_2"] == pytest.approx(2 / 3)
    assert metrics["accuracy/chain_sum"] == pytest.approx(0.75)
    assert metrics["accuracy/word_sorting"] == 0.0
    assert not any(k.startswith("accuracy/") for k in task_metrics(scores, 2, None))
