"""The TRL side of bench/peers/grpo_vs_trl.py: TRL 1.12's GRPOTrainer on the same model, rows,
verifier and settings as this project's run, timed per iteration, stopped at a wall clock.

Runs in bench/.trl-venv (made by bench/peers/setup_trl.sh, which adds math-verify), never in the
project's own environment. It reads one JSON job from ``--job`` and writes, to ``--out``, the
seconds at the end of each optimizer step, the rollout accuracy TRL logged per step, and the
LoRA adapter it trained (``adapter/``, peft's layout, as the project's candidates hold it).

The reward is the project's own verifier, ``ppo_core.rewards.verifiers.MathAnswerChecker``
(standard library only, its math-verify worker run by this venv's Python), as TRL's
``reward_funcs``, plus the project's missing-EOS penalty as a second function of weight 1: a
completion whose last id is not a stop id loses ``missing_eos_penalty``, as
``ppo.missing_eos_penalty`` does.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    job = json.loads(args.job.read_text())
    sys.path.insert(0, job["root"])  # the project's verifier; it imports nothing but the stdlib

    import torch

    torch.set_num_threads(job["threads"])
    torch.manual_seed(job["seed"])
    from _trl_side import _lora_config  # beside this file: the PPO side's LoRA config
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from ppo_core.rewards.verifiers import MathAnswerChecker

    tokenizer = AutoTokenizer.from_pretrained(job["policy"])
    model = AutoModelForCausalLM.from_pretrained(job["policy"], dtype=torch.float32)
    rows = [json.loads(line) for line in Path(job["rows"]).read_text().splitlines()]
    dataset = Dataset.from_list([{"prompt": r["messages"], "answer": r["answer"]} for r in rows])
    checker = MathAnswerChecker(seconds=5.0)
    stops = _stop_ids(tokenizer, model)

    def math_answer(completions, answer, **_):
        return [
            checker.check(_text(c), str(a)).score for c, a in zip(completions, answer, strict=True)
        ]

    def missing_eos(completion_ids, **_):
        penalty = job["missing_eos_penalty"]
        return [0.0 if ids and int(ids[-1]) in stops else -penalty for ids in completion_ids]

    clock = _clock(job["wall_s"])
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[math_answer, missing_eos],
        args=_grpo_config(job),
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=_lora_config(job),
        callbacks=[clock],
    )
    trainer.train()
    checker.close()
    trainer.save_model(str(args.out / "adapter"))
    (args.out / "trl.json").write_text(
        json.dumps(
            {
                "step_end_s": clock.marks,
                "accuracy_by_step": clock.accuracy,
                "kl_by_step": clock.kl,
                "steps": len(clock.marks),
                "parameter_dtype": str(next(model.parameters()).dtype),
                "mixed_precision": str(trainer.accelerator.mixed_precision),
                "gradient_checkpointing": bool(trainer.args.gradient_checkpointing),
            },
            indent=1,
        )
    )


def _text(completion) -> str:
    """A completion's text: the assistant turn's content for a chat, else the string."""
    if isinstance(completion, list):
        return "".join(turn.get("content", "") for turn in completion)
    return str(completion)


def _stop_ids(tokenizer, model) -> set[int]:
    found = model.generation_config.eos_token_id
    ids = set(found if isinstance(found, list) else [found] if found is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def _clock(wall_s: float):
    """A callback that records each optimizer step's end (seconds since training began) and
    TRL's logged rollout accuracy and KL, and stops training once ``wall_s`` has passed."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.start = 0.0
            self.marks: list[float] = []
            self.accuracy: list[float] = []
            self.kl: list[float] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.marks.append(time.perf_counter() - self.start)
            if self.marks[-1] >= wall_s:
                control.should_training_stop = True

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = logs or {}
            if "rewards/math_answer/mean" in logs:
                self.accuracy.append(float(logs["rewards/math_answer/mean"]))
            if "kl" in logs:
                self.kl.append(float(logs["kl"]))

    return Clock()


def _grpo_config(job: dict):
    """GRPOConfig with the project run's settings: ``rollout`` completions a generation
    (``rollout / generations`` prompts), optimizer steps of ``mini`` completions in micro-batches
    of ``micro``, one pass, the KL in the loss (k3, TRL's), AdamW betas (0.9, 0.95), a constant
    learning rate, token-level loss over the batch (``dapo``; the project's ``token-mean``),
    rewards scaled by the group's std (GRPO), fp32 on the CPU."""
    from trl import GRPOConfig

    micro, mini, rollout = job["micro"], job["mini"], job["rollout"]
    return GRPOConfig(
        output_dir=job["output_dir"],
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=mini // micro,
        steps_per_generation=rollout // micro,
        num_generations=job["generations"],
        max_completion_length=job["max_new_tokens"],
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        beta=job["kl_coef"],
        epsilon=0.2,
        num_iterations=1,
        loss_type="dapo",
        scale_rewards="group",
        reward_weights=[1.0, 1.0],
        learning_rate=job["lr"],
        adam_beta1=0.9,
        adam_beta2=0.95,
        weight_decay=0.0,
        max_grad_norm=1.0,
        lr_scheduler_type="constant",
        # TRL's GRPO turns it on by default; the project's runs recompute nothing
        gradient_checkpointing=False,
        max_steps=job["iterations"] * (rollout // mini),
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=job["seed"],
    )


if __name__ == "__main__":
    main()
