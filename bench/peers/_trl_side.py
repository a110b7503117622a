"""The TRL side of bench/peers/ppo_vs_trl.py: time TRL 1.12's PPOTrainer, per iteration.

Runs in bench/.trl-venv (made by bench/peers/setup_trl.sh), never in the project's own environment.
It reads one JSON job (model folders, prompts, sizes) from ``--job`` and writes per-iteration
seconds (rollout, update) to ``--out``.

How the phases are timed without changing TRL: the iteration ends at the trainer's
``on_step_end`` callback; the rollout ends when the advantages are whitened (TRL's
``masked_whiten`` is called once per iteration there, with ``whiten_rewards=False``, right
before its PPO epochs begin). Everything between two ``on_step_end`` calls is the iteration.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    job = json.loads(args.job.read_text())

    import torch

    torch.set_num_threads(job["threads"])
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from trl.experimental.ppo import PPOTrainer

    marks, clock = _clocks()
    torch.manual_seed(job["seed"])
    tokenizer = AutoTokenizer.from_pretrained(job["policy"], padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(job["policy"], dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(job["policy"], dtype=torch.float32)
    reward = AutoModelForSequenceClassification.from_pretrained(job["reward"], num_labels=1)
    value = AutoModelForSequenceClassification.from_pretrained(job["reward"], num_labels=1)
    prompts = [json.loads(line)["prompt"] for line in Path(job["prompts"]).read_text().splitlines()]

    def tokenized(texts: list[str]) -> Dataset:
        return Dataset.from_dict({"input_ids": [tokenizer(t)["input_ids"] for t in texts]})

    peft_config = _lora_config(job)
    if peft_config is not None:
        reference = None  # the policy with its adapter switched off, as on our side
    trainer = PPOTrainer(
        args=_ppo_config(job),
        peft_config=peft_config,
        processing_class=tokenizer,
        model=policy,
        ref_model=reference,
        reward_model=reward,
        value_model=value,
        train_dataset=tokenized(prompts),
        eval_dataset=tokenized(prompts[: job["micro"]]),
        callbacks=[clock],
    )
    trainer.train()
    ends, whitened = marks["step_end"], marks["whitened"]
    iterations = [
        {
            "rollout_s": whitened[i] - ends[i],
            "update_s": ends[i + 1] - whitened[i],
            "iteration_s": ends[i + 1] - ends[i],
        }
        for i in range(len(whitened))
    ]
    reached = _reached(trainer, policy, value)
    args.out.write_text(json.dumps({"iterations": iterations, "reached": reached}))


def _clocks():
    """The times each rollout ends (TRL whitens the advantages right after it) and each step
    ends, and the callback that marks the steps."""
    from transformers import TrainerCallback
    from trl.experimental.ppo import ppo_trainer as trl_ppo

    marks: dict[str, list[float]] = {"whitened": [], "step_end": []}
    original_whiten = trl_ppo.masked_whiten

    def timed_whiten(*a, **k):
        result = original_whiten(*a, **k)
        marks["whitened"].append(time.perf_counter())
        return result

    trl_ppo.masked_whiten = timed_whiten

    class StepClock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            marks["step_end"].append(time.perf_counter())

        def on_step_end(self, *a, **k):
            marks["step_end"].append(time.perf_counter())

    return marks, StepClock()


def _ppo_config(job: dict):
    """TRL's PPOConfig with the job's sizes and this project's defaults (k1 KL, clip 0.2, value
    clip 0.2, vf_coef 0.1, no reward whitening, fp32 on the CPU)."""
    from trl.experimental.ppo import PPOConfig

    batch, micro = job["batch"], job["micro"]
    return PPOConfig(
        output_dir=job["output_dir"],
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=batch // micro,
        num_mini_batches=batch // job["mini"],
        local_rollout_forward_batch_size=job["forward_batch"],
        total_episodes=batch * job["iterations"],
        num_ppo_epochs=job["epochs"],
        response_length=job["response_length"],
        stop_token="eos",
        temperature=1.0,
        kl_coef=job["kl_coef"],
        kl_estimator="k1",
        cliprange=0.2,
        cliprange_value=0.2,
        vf_coef=0.1,
        gamma=1.0,
        lam=0.95,
        whiten_rewards=False,
        learning_rate=job["lr"],
        lr_scheduler_type="constant",
        num_sample_generations=0,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=job["seed"],
    )


def _lora_config(job: dict):
    """peft's LoraConfig of the job's rank on every linear layer, or None without one."""
    if not job.get("lora_rank"):
        return None
    from peft import LoraConfig

    return LoraConfig(
        r=job["lora_rank"],
        lora_alpha=2 * job["lora_rank"],
        lora_dropout=0.0,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )


def _reached(trainer, policy, value) -> dict:
    """What actually reached the run (PPOConfig's bf16 and gradient_checkpointing defaults do
    not: PPOTrainer builds its own Accelerator and never enables checkpointing)."""
    return {
        "accelerator_mixed_precision": str(trainer.accelerator.mixed_precision),
        "gradient_checkpointing": bool(policy.is_gradient_checkpointing),
        "parameter_dtype": str(next(policy.parameters()).dtype),
        "policy_trainable_parameters": sum(
            p.numel() for p in trainer.policy_model.parameters() if p.requires_grad
        ),
        "value_trainable_parameters": sum(p.numel() for p in value.parameters() if p.requires_grad),
    }


if __name__ == "__main__":
    main()
