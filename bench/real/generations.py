"""Scheduled retraining over several generations of a real model: the published SmolLM2 recipe
(``bench/real/real_model.py``) run generation after generation, each importing the current
production version as its base, as ``from_production`` does.

In one project folder (``--work``): generation 0 imports SmolLM2-135M-Instruct from its GGUF
file (the chain's origin); then, for each generation, new film-review requests arrive in
``data/raw`` (``--new-prompts`` each), ``prepare`` and ``validate`` make the next data version,
``base`` imports the current production version (a LoRA version becomes its merged whole model),
``train`` runs ``--iterations`` LoRA iterations on it, ``evaluate`` measures the candidate against
the production baseline and against the origin, and ``promote`` decides. It writes
``bench/results/generations.json`` (per generation: held-out score of candidate and baseline
with standard errors, KL to the baseline and to the origin, EOS rate, distinct-2, the
reference's and the origin's NLL, the decision and its reasons) and ``docs/generations.png``
(score and drift by generation).

    .venv/bin/python -m bench.real.generations                   # about an hour on 2 CPU cores
    .venv/bin/python -m bench.real.generations --generations 2 --iterations 6
    .venv/bin/python -m bench.real.generations --smoke           # the tiny default, seconds
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    from bench import common
    from bench.common import (
        SMOKE_TRAINING,
        TRAINING,
        chat_prompts,
        smoke_chat_model,
        smollm2_gguf,
    )

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/ppo-generations"))
    parser.add_argument("--generations", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=12, help="training iterations each")
    parser.add_argument("--first-prompts", type=int, default=280)
    parser.add_argument("--new-prompts", type=int, default=140, help="arriving each generation")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", nargs="*", default=[], help="more key=value settings")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "generations.json")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "generations.png")
    parser.add_argument("--smoke", action="store_true", help=common.HELP)
    args = parser.parse_args()
    overrides = [*TRAINING, f"threads={args.threads}", f"train.iterations={args.iterations}"]
    if args.smoke:
        smoke = common.output_folder("generations")
        args.work, args.out, args.plot = smoke / "project", smoke / "g.json", smoke / "g.png"
        args.generations, args.first_prompts, args.new_prompts = 2, 160, 40
        source = str(smoke_chat_model(smoke / "tiny"))
        overrides += [
            *SMOKE_TRAINING,
            # a tiny model trained for one iteration passes no real gate: promote it anyway,
            # so that the smoke run chains
            "promote.min_improvement=-10",
            "promote.min_eos_rate=0",
            "promote.max_check_drop=10",
            "promote.max_distinct_2_drop=null",
            "promote.max_nll_increase=null",
        ]
    else:
        source = str(smollm2_gguf())
    total = args.first_prompts + args.new_prompts * (args.generations - 1)
    prompts = chat_prompts(total)
    rows = run(args, source, [*overrides, *args.set], prompts)
    write_results(args, rows, [*overrides, *args.set])


def run(args, source: str, overrides: list[str], prompts: list[dict]) -> list[dict]:
    """Generation 0 (the GGUF import), then ``args.generations`` scheduled runs; one row each."""
    from flows import stages
    from ppo_core.config import load_config
    from ppo_core.registry.versions import load_registry

    if args.work.exists():
        shutil.rmtree(args.work)
    raw = args.work / "data" / "raw"
    raw.mkdir(parents=True)
    os.chdir(args.work)
    stages.base(load_config(overrides=[f"base.source={source}", *overrides]))
    rows = []
    arrived = args.first_prompts
    for generation in range(1, args.generations + 1):
        started = time.perf_counter()
        batch = (
            prompts[: args.first_prompts]
            if generation == 1
            else prompts[arrived:][: args.new_prompts]
        )
        if generation > 1:
            arrived += len(batch)
        (raw / f"chats-{generation:02d}.jsonl").write_text(
            "".join(json.dumps(row) + "\n" for row in batch)
        )
        current = load_registry("models/registry.json")["current"]
        config = load_config(overrides=overrides)
        if current is not None:  # what the flow's from_production sets for the run
            stages.base(
                load_config(overrides=[*overrides, f"base.source=models/production/{current}"])
            )
        stages.prepare(config)
        stages.validate(config)
        stages.train(config, show_progress=True)
        stages.evaluate(config)
        promotion = stages.promote(config)
        rows.append(generation_row(config, generation, current, promotion, started))
        print(json.dumps(rows[-1], indent=1), flush=True)
    return rows


def generation_row(config, generation: int, parent, promotion: dict, started: float) -> dict:
    metrics = json.loads((Path(config.eval.output_dir) / "metrics.json").read_text())
    responses = config.eval.num_prompts * config.eval.samples_per_prompt

    def side(name: str) -> dict:
        found = {k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith(f"{name}/")}
        found["score_stderr"] = found.get("score_std", 0.0) / math.sqrt(responses)
        return found

    return {
        "generation": generation,
        "parent": parent,
        "candidate": side("candidate"),
        "baseline": side("baseline"),
        "decision": promotion["decision"],
        "version": promotion.get("version"),
        "reasons": promotion["reasons"],
        "wall_s": time.perf_counter() - started,
    }


def write_results(args, rows: list[dict], overrides: list[str]) -> None:
    import torch

    from bench import common

    result = {
        "model": "tiny" if args.smoke else "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)",
        "settings": overrides,
        "first_prompts": args.first_prompts,
        "new_prompts_each": args.new_prompts,
        "generations": rows,
        "torch": torch.__version__,
        "threads": args.threads,
        "machine": common.machine(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(rows, args.plot)
    print(f"wrote {args.out} and {args.plot}")


def plot(rows: list[dict], path: Path) -> None:
    """Held-out score of each generation's baseline and candidate (with standard errors), and
    the candidate's KL to its baseline and to the chain's origin."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    generations = [row["generation"] for row in rows]
    fig, (score, drift) = plt.subplots(1, 2, figsize=(9, 3.6))
    for name, style in (("baseline", "o--"), ("candidate", "o-")):
        score.errorbar(
            generations,
            [row[name]["score"] for row in rows],
            yerr=[row[name]["score_stderr"] for row in rows],
            fmt=style,
            capsize=3,
            label=name,
        )
    for row in rows:
        score.annotate(row["decision"], (row["generation"], row["candidate"]["score"]), fontsize=7)
    score.set(xlabel="generation", ylabel="held-out score", xticks=generations)
    score.legend()
    for key, label in (("kl_to_reference", "to its baseline"), ("kl_to_origin", "to the origin")):
        drift.plot(
            generations, [row["candidate"].get(key, math.nan) for row in rows], "o-", label=label
        )
    drift.set(xlabel="generation", ylabel="KL (nats / response)", xticks=generations)
    drift.legend()
    fig.suptitle("Scheduled retraining, generation after generation")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
