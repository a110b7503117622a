"""What a model folder brings that is run, not read: a chat template (Jinja, in transformers'
sandbox, which stops code but not loops or huge strings) and the patterns of an adapter config
(regular expressions peft matches against every module name). Each is bounded or refused by
name, instead of hanging a stage."""

from __future__ import annotations

import json
import time

import pytest
from transformers import AutoTokenizer

from ppo_core.models import generation
from ppo_core.models.adapter_folders import AdapterError, check_adapter_folder
from ppo_core.models.generation import ChatTemplateError, prompt_token_ids

CHAT = [{"role": "user", "content": "Review a film."}]


@pytest.fixture
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_a_template_that_loops_for_ever_is_stopped_by_name(tokenizer, monkeypatch):
    monkeypatch.setattr(generation, "CHAT_TEMPLATE_SECONDS", 0.5)
    tokenizer.chat_template = (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    )
    started = time.monotonic()
    with pytest.raises(ChatTemplateError, match="took longer than 0.5 s to render one chat"):
        prompt_token_ids(tokenizer, [CHAT])
    assert time.monotonic() - started < 5


def test_a_template_that_renders_megabytes_is_refused(tokenizer):
    tokenizer.chat_template = "{{ 'A' * 2000000 }}"
    with pytest.raises(ChatTemplateError, match="rendered a chat of 2000000 characters"):
        prompt_token_ids(tokenizer, [CHAT])


def test_an_honest_template_renders_as_before(tokenizer):
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    expected = tokenizer("Review a film.", add_special_tokens=False)["input_ids"]
    assert prompt_token_ids(tokenizer, [CHAT]) == [expected]


def adapter(tmp_path, **config):
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_model.safetensors").write_bytes(b"")
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", **config}))
    return folder


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"target_modules": "(.*.*)*X"}, "target_modules is the regular expression '(.*.*)*X'"),
        ({"target_modules": ["q_proj"], "exclude_modules": ".*"}, "exclude_modules"),
        ({"target_modules": ["q_proj"], "rank_pattern": {"(a+)+$": 4}}, "rank_pattern"),
        ({"target_modules": ["q_proj"], "alpha_pattern": {"layers.*": 8}}, "alpha_pattern"),
    ],
)
def test_an_adapter_config_with_a_pattern_is_refused_before_peft_matches_it(
    tmp_path, config, named
):
    started = time.monotonic()
    with pytest.raises(AdapterError, match="module names only") as refused:
        check_adapter_folder(adapter(tmp_path, **config), "model.lora.adapter")
    assert named in str(refused.value)
    assert time.monotonic() - started < 1


def test_an_adapter_config_with_module_names_passes(tmp_path):
    folder = adapter(
        tmp_path,
        target_modules=["q_proj", "v_proj"],
        rank_pattern={"model.layers.0.self_attn.q_proj": 4},
    )
    assert check_adapter_folder(folder, "model.lora.adapter") == folder
