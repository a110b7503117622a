"""LoRA with peft: the reference is the policy's own weights with the adapter off (or a frozen
copy of a starting adapter), the exact update and resume hold, candidates are an adapter plus
the base it needs or merged weights, and bad adapters are refused before anything is written.
Gradient checkpointing leaves the gradients as they were, with and without LoRA."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ppo_core.config import ConfigError, load_config
from ppo_core.files import tree_sha256
from ppo_core.models.causal_lm import checkpoint_blocks, load_tokenizer
from ppo_core.models.lora import (
    AdapterError,
    AdapterReference,
    LoraSettings,
    LoraWeights,
    add_lora,
    save_adapter,
)
from ppo_core.models.policy import load_actor_critic, load_causal_lm
from ppo_core.models.scoring import score_sequences
from ppo_core.registry.versions import load_registry, record_decision
from ppo_core.training.loop import train
from tests.helpers import (
    VARIED,
    adapter_parameters,
    build_tiny_causal_lm,
    max_relative_difference,
    parameters_after_one_sgd_iteration,
    small_config,
)

LORA = "model.lora.enabled=true"
PROMPTS = ["The movie was", "Honestly, I thought the acting", "This film"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_tiny_causal_lm(tmp_path_factory.mktemp("lora") / "llama", "llama")


def batch_for(folder):
    """Prompts and fixed responses of the tiny tokenizer, left-padded."""
    from ppo_core.models.generation import encode_prompts

    tokenizer = load_tokenizer(folder)
    prompt_ids, prompt_mask = encode_prompts(tokenizer, PROMPTS)
    torch.manual_seed(0)
    response_ids = torch.randint(3, 200, (len(PROMPTS), 5))
    response_mask = torch.ones_like(response_ids, dtype=torch.bool)
    response_mask[1, 3:] = False
    return prompt_ids, prompt_mask, response_ids, response_mask


def logprobs(model, batch):
    with torch.no_grad():
        return score_sequences(model, *batch, with_values=False).logprobs


def random_adapter(base, folder, seed=1):
    """A LoRA adapter of ``base`` with random (non-zero) weights, as supervised fine-tuning
    would leave one, saved by this project's writer."""
    model = add_lora(load_causal_lm(base), LoraSettings(rank=4))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.normal_(0, 0.3)
    save_adapter(model, folder, base)
    return folder


# -- the reference --------------------------------------------------------------------------------


def test_a_fresh_adapter_starts_as_the_base_and_the_reference_shares_its_weights(llama):
    batch = batch_for(llama)
    base_logprobs = logprobs(load_causal_lm(llama), batch)
    actor_critic = load_actor_critic(llama, weights=LoraWeights(LoraSettings(rank=4), llama))
    reference = AdapterReference(actor_critic.policy, reference_adapter=False)
    # B starts at zero: the adapted policy is the base exactly
    assert torch.equal(logprobs(actor_critic.policy, batch), base_logprobs)
    # only the adapters and the value head train; the reference holds no weights of its own
    trainable = {n for n, p in actor_critic.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or n.startswith("value_head.") for n in trainable)
    assert list(reference.parameters()) == []
    with torch.no_grad():
        for name, parameter in actor_critic.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.3)
    moved = logprobs(actor_critic.policy, batch)
    assert (moved - base_logprobs).abs().max() > 1e-3  # the adapter now changes the policy ...
    assert torch.equal(logprobs(reference, batch), base_logprobs)  # ... and the reference not
    assert torch.equal(logprobs(actor_critic.policy, batch), moved)  # the adapter is back on
    assert all(p.requires_grad for n, p in actor_critic.named_parameters() if n in trainable)


def test_with_a_starting_adapter_the_reference_is_a_frozen_copy_of_it(
    tmp_path, llama, prompt_files
):
    """An adapter from supervised fine-tuning: PPO trains it further, and the KL is measured
    against it, not against the bare base (whose KL would not start at 0)."""
    sft = random_adapter(llama, tmp_path / "sft")
    extra = (LORA, f"model.lora.adapter={sft}", "train.iterations=1", VARIED)
    own = train(small_config(tmp_path / "own", llama, prompt_files, *extra, "train.iterations=2"))
    assert own.history[0]["rollout/kl"] == 0.0  # policy = starting adapter = reference
    # then the trained adapter moves away from the frozen copy
    assert abs(own.history[1]["rollout/kl"]) > 1e-6
    against_base = train(
        small_config(tmp_path / "bare", llama, prompt_files, *extra, f"model.reference={llama}")
    )
    assert abs(against_base.history[0]["rollout/kl"]) > 1e-2
    # the reference copy stayed where it started while the trained adapter moved
    trained = adapter_parameters(tmp_path / "own" / "candidate")
    started = load_file(str(sft / "adapter_model.safetensors"))
    assert max_relative_difference({k: trained[k] for k in started}, started) > 1e-4


def test_a_lora_runs_logged_kl_is_measured_against_the_model_with_the_adapter_off(
    tmp_path, llama, prompt_files, monkeypatch
):
    """The run's own reference (the policy's weights with the adapter switched off) against an
    independent one, the base model loaded on its own: by iteration 2 the adapter has moved, and
    the logged KL is the KL of the sampled responses from that base, not from the policy."""
    from ppo_core.math.kl import kl_penalty
    from ppo_core.math.masked import masked_sum
    from ppo_core.training import loop as trainer

    rollouts = []
    collect = trainer.collect_rollout

    def kept(*args, **kwargs):
        batch, metrics, responses = collect(*args, **kwargs)
        rollouts.append(batch)
        return batch, metrics, responses

    monkeypatch.setattr(trainer, "collect_rollout", kept)
    config = small_config(tmp_path, llama, prompt_files, LORA, VARIED)
    history = train(config).history
    batch = rollouts[1]
    mask = batch.response_mask
    fields = (batch.prompt_ids, batch.prompt_mask, batch.response_ids, mask)
    temperature = config.generation.temperature
    with torch.no_grad():
        base = score_sequences(
            load_causal_lm(llama), *fields, temperature=temperature, with_values=False
        ).logprobs
        # and the sampling policy is the adapter after iteration 1, as checkpoint 1 holds it
        policy = score_sequences(
            load_causal_lm(tmp_path / "checkpoints" / "step-000001" / "model"),
            *fields,
            temperature=temperature,
            with_values=False,
        ).logprobs
    # the merged adapter rounds otherwise than adapter and base apart: 1.9e-6 measured
    torch.testing.assert_close(policy[mask], batch.old_logprobs[mask], rtol=0, atol=1e-5)
    token_kl = kl_penalty(batch.old_logprobs, base, config.kl.estimator, mask)
    expected = float(masked_sum(token_kl, mask, dim=1).mean())
    assert abs(expected) > 1e-3  # the adapter moved the policy away from the base
    # the same base over other chunks of rows, each cut to its own lengths: measured 6.0e-6
    # relative; the adapter left on logs 0 instead of -2.5e-3
    assert history[1]["rollout/kl"] == pytest.approx(expected, rel=5e-5, abs=1e-9)


# -- the exact update -------------------------------------------------------------------------------


def test_micro_batch_size_does_not_change_the_lora_update(tmp_path, llama, prompt_files):
    results = parameters_after_one_sgd_iteration(
        tmp_path, llama, prompt_files, LORA, VARIED, read=adapter_parameters
    )
    lora_b = {k: v for k, v in results[8].items() if "lora_B" in k}
    assert max(float(v.abs().max()) for v in lora_b.values()) > 1e-4  # B left zero: it trained
    assert max_relative_difference(results[1], results[8]) <= 5e-5  # 2.4e-6 measured


def test_a_resumed_lora_run_matches_an_uninterrupted_one(tmp_path, llama, prompt_files):
    train(small_config(tmp_path / "full", llama, prompt_files, "train.iterations=3", LORA, VARIED))
    part = tmp_path / "part"
    train(small_config(part, llama, prompt_files, "train.iterations=1", LORA, VARIED))
    checkpoint = sorted((part / "checkpoints").glob("step-*"))[-1] / "model"
    assert (checkpoint / "adapter_model.safetensors").is_file()
    assert not (checkpoint / "model.safetensors").exists()  # only the adapter is checkpointed
    summary = train(small_config(part, llama, prompt_files, "train.iterations=3", LORA, VARIED))
    assert summary.resumed_from == 1
    assert (
        max_relative_difference(
            adapter_parameters(part / "candidate"),
            adapter_parameters(tmp_path / "full" / "candidate"),
        )
        == 0.0
    )


# -- candidates -----------------------------------------------------------------------------------


def test_adapter_and_merged_candidates_are_the_same_policy_and_promote(
    tmp_path, llama, prompt_files
):
    common = ("train.iterations=1", LORA, VARIED)
    train(small_config(tmp_path / "adapter", llama, prompt_files, *common))
    train(small_config(tmp_path / "merged", llama, prompt_files, *common, "model.lora.merge=true"))
    adapter, merged = tmp_path / "adapter" / "candidate", tmp_path / "merged" / "candidate"
    assert (adapter / "adapter_base.json").is_file() and not (adapter / "config.json").exists()
    assert not (adapter / "README.md").exists()  # peft's card would name absolute paths
    assert (merged / "model.safetensors").is_file() and not (
        merged / "adapter_config.json"
    ).exists()
    record = json.loads((adapter / "adapter_base.json").read_text())
    assert record["base"] == str(llama) and len(record["base_sha256"]) == 64

    batch = batch_for(llama)
    from_adapter = logprobs(load_causal_lm(adapter), batch)
    from_merged = logprobs(load_causal_lm(merged), batch)
    assert (from_adapter - logprobs(load_causal_lm(llama), batch)).abs().max() > 1e-4
    torch.testing.assert_close(from_adapter, from_merged, rtol=0, atol=1e-5)

    from ppo_core.registry.gate import GateDecision

    registry = tmp_path / "registry.json"
    entry = record_decision(
        registry_path=registry,
        production_dir=tmp_path / "production",
        candidate_dir=adapter,
        decision=GateDecision(True, []),
        lineage={},
    )
    # the registry says which base the version needs: a copy of it kept in production
    stored = tmp_path / "production" / "bases" / record["base_sha256"]
    assert entry["adapter_base"] == {
        "path": str(stored),
        "base_sha256": record["base_sha256"],
        "content_sha256": tree_sha256(stored),
    }
    production = tmp_path / "production" / entry["version"]
    assert json.loads((production / "adapter_base.json").read_text())["base"] == str(stored)
    assert load_registry(registry)["current"] == entry["version"]
    torch.testing.assert_close(logprobs(load_causal_lm(production), batch), from_adapter)


def test_every_file_of_a_stored_base_is_checked_and_a_planted_one_is_not_adopted(tmp_path, llama):
    """A generation_config.json planted in an adapter version's stored base (its eos_token_id
    would end every exported reply early) is refused by name; a bases/<fingerprint> folder the
    registry never recorded, holding a file the base does not, is refused, not adopted."""
    import shutil

    from ppo_core.models.adapter_folders import base_fingerprint
    from ppo_core.registry.gate import GateDecision
    from ppo_core.registry.lineage import LineageError
    from ppo_core.registry.versions import RegistryError, check_version

    adapter = random_adapter(llama, tmp_path / "adapter")
    registry, production = tmp_path / "registry.json", tmp_path / "production"
    promote = {"decision": GateDecision(True, []), "lineage": {}, "candidate_dir": adapter}
    entry = record_decision(registry_path=registry, production_dir=production, **promote)
    stored = Path(entry["adapter_base"]["path"])
    assert check_version(registry, production, entry["version"])
    planted = stored / "generation_config.json"
    had = planted.read_bytes() if planted.exists() else None
    planted.write_text(json.dumps({"eos_token_id": 5}))
    with pytest.raises(RegistryError, match=f"the base of production version {entry['version']}"):
        check_version(registry, production, entry["version"])
    planted.unlink() if had is None else planted.write_bytes(had)
    assert check_version(registry, production, entry["version"])

    elsewhere = tmp_path / "elsewhere"
    foreign = elsewhere / "production" / "bases" / base_fingerprint(llama)
    shutil.copytree(llama, foreign)
    (foreign / "extra.py").write_text("import os")
    with pytest.raises(LineageError, match=r"holds files the base .* does not \(extra.py\)"):
        record_decision(
            registry_path=elsewhere / "registry.json",
            production_dir=elsewhere / "production",
            **promote,
        )
    assert not (elsewhere / "registry.json").exists()
    assert sorted(p.name for p in (elsewhere / "production").iterdir()) == ["bases"]


def test_an_adapter_on_another_base_is_refused_by_name(tmp_path, llama, prompt_files):
    adapter = random_adapter(llama, tmp_path / "sft")
    other = build_tiny_causal_lm(tmp_path / "other", "llama", seed=5)  # same shapes
    with pytest.raises(AdapterError, match=r"adapter folder .*sft.* was trained on a base"):
        train(
            small_config(
                tmp_path / "run", other, prompt_files, LORA, f"model.lora.adapter={adapter}"
            )
        )
    assert not (tmp_path / "run" / "candidate").exists()
    # a production adapter whose base was rebuilt is refused too, naming both folders
    record = json.loads((adapter / "adapter_base.json").read_text())
    record["base"] = str(other)
    (adapter / "adapter_base.json").write_text(json.dumps(record))
    with pytest.raises(AdapterError, match=rf"{other}"):
        load_causal_lm(adapter)


def test_an_adapter_record_cannot_switch_its_base_check_off(tmp_path, llama):
    """``adapter_base.json`` edited to hold no fingerprint (null, empty, not a SHA-256) is
    refused rather than loading the adapter onto any base; one naming an adapter (itself) as
    its base is refused rather than followed for ever."""
    adapter = random_adapter(llama, tmp_path / "sft")
    other = build_tiny_causal_lm(tmp_path / "other", "llama", seed=5)  # same shapes
    record_file = adapter / "adapter_base.json"
    fingerprint = json.loads(record_file.read_text())["base_sha256"]
    for edited in (None, "", "abc"):
        record_file.write_text(json.dumps({"base": str(other), "base_sha256": edited}))
        with pytest.raises(AdapterError, match=r"base_sha256 is .*, not a SHA-256"):
            load_causal_lm(adapter)
    record_file.write_text(json.dumps({"base": str(adapter), "base_sha256": fingerprint}))
    with pytest.raises(AdapterError, match="which is itself an adapter folder"):
        load_causal_lm(adapter)


def test_bad_lora_settings_are_named(tmp_path, llama, prompt_files):
    with pytest.raises(ConfigError, match="model.lora.rank must be >= 1, got 0"):
        load_config(overrides=[LORA, "model.lora.rank=0"])
    with pytest.raises(ConfigError, match="model.lora.adapter=.* needs model.lora.enabled=true"):
        load_config(overrides=["model.lora.adapter=somewhere"])
    with pytest.raises(ConfigError, match="model.critic=separate is not supported"):
        load_config(overrides=[LORA, "model.critic=separate"])
    config = small_config(
        tmp_path, llama, prompt_files, LORA, "model.lora.target_modules=[q_proj,attn_out]"
    )
    with pytest.raises(
        AdapterError,
        match=r"model.lora.target_modules=\['q_proj', 'attn_out'\]: the model has no module named 'attn_out'.*"
        r"linear layers end in: .*o_proj",
    ):
        train(config)
    assert not (tmp_path / "candidate").exists() and not (tmp_path / "checkpoints").exists()
    with pytest.raises(AdapterError, match="has no adapter_config.json"):
        train(small_config(tmp_path, llama, prompt_files, LORA, f"model.lora.adapter={llama}"))


# -- gradient checkpointing -----------------------------------------------------------------------


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_gradient_checkpointing_gives_the_same_gradients(tmp_path, llama, lora):
    """float64, 1e-10: the same gradients, and each block's forward pass really runs again in
    the backward pass (so the memory saving is real)."""
    batch = batch_for(llama)

    def weights():
        return LoraWeights(LoraSettings(rank=4), llama) if lora else None

    def gradients(checkpointed: bool):
        torch.manual_seed(0)
        model = load_actor_critic(llama, dtype=torch.float64, weights=weights())
        with torch.no_grad():  # a non-zero B and value head, so every gradient is non-zero
            for name, parameter in model.named_parameters():
                if "lora_B" in name or name.startswith("value_head."):
                    parameter.normal_(0, 0.1)
        calls = []
        blocks = [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]
        if checkpointed:
            assert checkpoint_blocks(model) == len(blocks) == 2
        mlp_forward = blocks[0].mlp.forward  # counted inside the block: a recompute runs it

        def counted(*args, **kwargs):
            calls.append(1)
            return mlp_forward(*args, **kwargs)

        blocks[0].mlp.forward = counted
        out = score_sequences(model, *batch, with_values=True)
        (out.logprobs.sum() + out.values.square().sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        return grads, len(calls)

    plain, plain_calls = gradients(False)
    checkpointed, checkpointed_calls = gradients(True)
    assert (plain_calls, checkpointed_calls) == (1, 2)
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        assert plain[name].abs().max() > 0, name
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=0, atol=1e-10)


def count_block_passes(monkeypatch) -> list[tuple[int, int]]:
    """Count, in each PPO update of the runs that follow, the calls of every transformer block
    and of the first module inside each block: ``(block calls, inner calls)`` per update. A
    checkpointed block runs its inner modules again during the backward pass (not the block's
    own ``__call__``), so inner = 2 x block with checkpointing and inner = block without."""
    from ppo_core.models.causal_lm import transformer_blocks
    from ppo_core.training import loop as trainer

    counts: list[tuple[int, int]] = []
    update = trainer.ppo_update

    def counted(model, *args, **kwargs):
        calls = {"block": 0, "inner": 0}

        def hook(kind):
            return lambda *_: calls.__setitem__(kind, calls[kind] + 1)

        blocks = transformer_blocks(model)
        handles = [b.register_forward_pre_hook(hook("block")) for b in blocks]
        handles += [next(b.children()).register_forward_pre_hook(hook("inner")) for b in blocks]
        try:
            return update(model, *args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
            counts.append((calls["block"], calls["inner"]))

    monkeypatch.setattr(trainer, "ppo_update", counted)
    return counts


def test_gradient_checkpointing_in_a_run_recomputes_every_block_and_changes_nothing(
    tmp_path, llama, prompt_files, monkeypatch
):
    """``train.gradient_checkpointing=true`` really checkpoints the run's model (every block's
    forward pass runs again in the backward pass), leaves it alone without the key, and gives
    the same weights up to float round-off."""
    passes = {}
    for name, extra in (("plain", ()), ("checkpointed", ("train.gradient_checkpointing=true",))):
        counts = count_block_passes(monkeypatch)
        train(
            small_config(tmp_path / name, llama, prompt_files, "train.iterations=1", VARIED, *extra)
        )
        assert len(counts) == 1  # one iteration, one update
        passes[name] = counts[0]
    blocks, inner = passes["plain"]
    # 2 blocks x 2 epochs x 2 mini-batches of one micro-batch each
    assert blocks == 2 * 2 * 2 and inner == blocks
    assert passes["checkpointed"] == (blocks, 2 * blocks)
    a = load_file(str(tmp_path / "plain" / "candidate" / "model.safetensors"))
    b = load_file(str(tmp_path / "checkpointed" / "candidate" / "model.safetensors"))
    assert max_relative_difference(a, b) <= 1e-5


_ = (shutil, warnings)


# -- sampling with the adapter merged -------------------------------------------------------------


def lora_calls(model, monkeypatch) -> list[int]:
    """Count the forward passes through LoRA ``A`` matrices (one per adapted layer and call)."""
    calls = [0]
    for name, module in model.named_modules():
        if name.endswith("lora_A.default"):
            module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_sampling_merges_the_adapter_into_copies_and_gives_every_weight_back(
    tmp_path, llama, family, monkeypatch
):
    """GPT-2's Conv1D layers store the weight transposed (peft's fan_in_fan_out)."""
    base = llama if family == "llama" else build_tiny_causal_lm(tmp_path / "gpt2", "gpt2")
    actor_critic = load_actor_critic(base, weights=LoraWeights(LoraSettings(rank=4), base))
    with torch.no_grad():
        for name, parameter in actor_critic.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.3)
    before = {n: (p, p.detach().clone()) for n, p in actor_critic.named_parameters()}
    batch = batch_for(base)
    adapted = logprobs(actor_critic.policy, batch)
    calls = lora_calls(actor_critic.policy, monkeypatch)
    with actor_critic.sampling_model() as sampler:
        merged = logprobs(sampler, batch)
        assert calls[0] == 0  # no adapter layer ran: the update is inside the weights
    # same policy up to the rounding of W + BA: measured 1.9e-6 (llama), 2.4e-6 (gpt2)
    assert (merged - adapted).abs().max() < 2e-5
    after = dict(actor_critic.named_parameters())
    assert after.keys() == before.keys()
    for name, (parameter, values) in before.items():
        assert after[name] is parameter and torch.equal(parameter, values), name
    assert torch.equal(logprobs(actor_critic.policy, batch), adapted)  # the adapter is back on
    assert calls[0] > 0
    with actor_critic.sampling_model(merge_adapter=False) as sampler:
        assert torch.equal(logprobs(sampler, batch), adapted)


def test_a_lora_run_samples_with_the_merged_adapter_and_scores_without_it(
    tmp_path, llama, prompt_files, monkeypatch
):
    """Merging changes how fast responses are sampled, not the update: the same run with the
    adapter left unmerged ends with the same adapter, bit for bit (the sampled tokens agree, and
    old logprobs, reference and update are computed on the unmerged model in both)."""
    import contextlib

    from ppo_core.models import lora

    merges = []
    real = lora.merged_for_sampling

    def counting(model):
        merges.append(1)
        return real(model)

    extra = (LORA, "train.iterations=2", VARIED)
    monkeypatch.setattr(lora, "merged_for_sampling", counting)
    merged = train(small_config(tmp_path / "merged", llama, prompt_files, *extra))
    assert len(merges) == 2  # one merged sampling block per iteration

    @contextlib.contextmanager
    def unmerged(model):
        yield model.get_base_model()

    monkeypatch.setattr(lora, "merged_for_sampling", unmerged)
    plain = train(small_config(tmp_path / "plain", llama, prompt_files, *extra))
    assert merged.history[-1]["rollout/score"] == plain.history[-1]["rollout/score"]
    first = adapter_parameters(tmp_path / "merged" / "candidate")
    second = adapter_parameters(tmp_path / "plain" / "candidate")
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_adapter_dropout_is_switched_on_for_the_update_and_changes_it(
    tmp_path, llama, prompt_files
):
    """`model.lora.dropout` > 0 reaches the update: the same run with dropout 0.5 ends with
    other adapter weights than with 0 (with dropout never switched on they would be equal)."""
    runs = {}
    for dropout in (0.0, 0.5):
        folder = tmp_path / f"dropout-{dropout}"
        train(
            small_config(folder, llama, prompt_files, LORA, VARIED, f"model.lora.dropout={dropout}")
        )
        runs[dropout] = adapter_parameters(folder / "candidate")
    # measured: 1.65 relative difference; equal runs differ by float round-off (< 1e-5) only
    assert max_relative_difference(runs[0.0], runs[0.5]) > 0.1
