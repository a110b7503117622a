"""Step 2 of the run (layer 3): every input checked before anything is written: model
folders, prompts, tokenizer and chat template, vocabulary against the reference, reward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ppo_core.config import Config, code_free_folders
from ppo_core.experience.engines import check_engine
from ppo_core.experience.judges import build_reward
from ppo_core.experience.sampling import longest_prompt
from ppo_core.files import check_replaceable
from ppo_core.models.adapter_folders import base_fingerprint
from ppo_core.models.causal_lm import load_tokenizer
from ppo_core.models.folders import ModelFolderError, check_model_folder
from ppo_core.models.generation import check_chat_template
from ppo_core.models.vocabulary import reference_vocabulary, vocabulary_mismatch, vocabulary_of
from ppo_core.parallel.runtime import Runtime
from ppo_core.prompts import Prompt, load_prompts, read_manifest_hash
from ppo_core.references import Reference, load_references
from ppo_core.rewards.loading import RewardFn


@dataclass
class RunInputs:
    """Everything a run reads besides the weights, checked before anything is written."""

    train_prompts: list[Prompt]
    tokenizer: Any
    data_hash: str | None
    reward_fn: RewardFn
    base_sha256: str | None = None
    """Fingerprint of ``model.policy`` (config and weights): a checkpoint continues a run only
    on the base it started from (a new generation imports a new base under the same path)."""
    longest_prompt: int = 0
    """Tokens of the longest train prompt (within ``validation.max_tokens``, checked)."""
    train_references: list[Reference] | None = None
    """Each train prompt's ``data.reference_fields`` (None when none are declared)."""


def check_inputs(config: Config, runtime: Runtime) -> RunInputs:
    """Check the model folders, read the prompts and the tokenizer, build the reward; a bad
    input fails here, naming it, while every file on disk is as it was."""
    model = config.model
    # A foreign folder in the output's place would only be found at the final save.
    check_replaceable(config.train.output_dir)
    check_model_folder(model.policy, "model.policy")
    check_engine(config, runtime)
    tokenizer = load_tokenizer(model.policy, model.trust_remote_code)
    if model.reference is not None:
        check_model_folder(model.reference, "model.reference")
        # The KL penalty compares the two models' logprobs of one token id: meaningless unless
        # both vocabularies map ids to the same text.
        policy_vocab = vocabulary_of(model.policy, tokenizer)
        reference_vocab = reference_vocabulary(
            model.policy, model.reference, model.trust_remote_code
        )
        mismatch = vocabulary_mismatch(policy_vocab, reference_vocab)
        if mismatch is not None:
            raise ModelFolderError(
                f"model.reference {reference_vocab.describe()} has another tokenizer than "
                f"model.policy {policy_vocab.describe()}: {mismatch}; the KL penalty needs one "
                "vocabulary (model.reference=null uses the starting policy)"
            )
    train_prompts = load_prompts(
        config.data.train_file,
        config.data.prompt_field,
        max_rows=config.data.max_rows_per_file,
        max_bytes=config.data.max_bytes_per_file,
    )
    check_chat_template(tokenizer, train_prompts, model.policy, "model.policy")
    longest = longest_prompt(tokenizer, train_prompts, config, config.data.train_file)
    fields = config.data.reference_fields
    references = load_references(
        config.data.train_file,
        fields,
        max_rows=config.data.max_rows_per_file,
        max_bytes=config.data.max_bytes_per_file,
    )
    return RunInputs(
        train_prompts=train_prompts,
        tokenizer=tokenizer,
        data_hash=read_manifest_hash(config.data.train_file),
        reward_fn=build_reward(
            model,
            runtime.device,
            code_free=code_free_folders(config),
            versions_dir=config.reward_model.versions_dir,
            reference_fields=fields,
            with_terms=True,
        ),
        base_sha256=base_fingerprint(model.policy),
        longest_prompt=longest,
        train_references=references if fields else None,
    )


# Keys that may change between a run and its resumption without changing what it computes.
