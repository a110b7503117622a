"""GGUF export checked by llama.cpp itself: SmolLM2-135M-Instruct imported from its GGUF file,
trained with LoRA PPO, promoted, exported by ``ppo export`` in f32, f16 and q8_0, and run by
llama.cpp (llama-cpp-python, in ``bench/.llama-venv``: ``bash bench/peers/setup_llama_cpp.sh``)
beside transformers on the promoted version.

In one project folder (``--work``): ``base`` imports the GGUF file, ``prepare`` and ``validate``
make a data version of film-review chats, ``train`` runs ``--iterations`` LoRA iterations of the
published recipe (``bench/real/real_model.py``), ``evaluate`` and ``promote`` make it production
version v0001 (the gate is set aside: this measures the export, not the training), and
``export`` writes each type. Then, for ``--chats`` held-out chats:

- transformers: the promoted version (the adapter merged into its base), the chat rendered by
  its tokenizer's template, greedy until ``<|im_end|>`` or ``--max-new-tokens``;
- llama.cpp: each exported file, the chat rendered by the template stored in the file and
  tokenized by the file's vocabulary, greedy the same way (``bench/peers/_llama_side.py``).

It reports, per type: the file's size, the export's time, llama.cpp's load time and tokens per
second, and the agreement: whether the prompt ids are the same, and the greedy tokens equal up to
the first difference, chat by chat. Results go to ``bench/results/export.json``.

    bash bench/peers/setup_llama_cpp.sh                    # once: builds llama.cpp (11 min on 2 cores)
    .venv/bin/python -m bench.peers.export                 # about 5 minutes on 2 CPU cores
    .venv/bin/python -m bench.peers.export --smoke         # the tiny default, seconds
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LLAMA_PYTHON = ROOT / "bench" / ".llama-venv" / "bin" / "python"

GATE_OFF = [
    "promote.min_improvement=-10",
    "promote.max_kl=1000",
    "promote.max_kl_from_origin=null",
    "promote.min_eos_rate=0",
    "promote.max_check_drop=10",
    "promote.max_distinct_2_drop=null",
    "promote.max_nll_increase=null",
]
"""The gate set aside: a candidate of one iteration is promoted whatever it scores (this
measures the export; tests/flows/test_export.py sets it aside the same way)."""


def main() -> None:
    from bench import common
    from bench.common import SMOKE_TRAINING, TRAINING, smoke_chat_model, smollm2_gguf

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/ppo-export"))
    parser.add_argument("--iterations", type=int, default=2, help="LoRA PPO iterations")
    parser.add_argument("--chats", type=int, default=12, help="held-out chats to compare")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--types", nargs="+", default=["f32", "f16", "q8_0"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", nargs="*", default=[], help="more key=value settings")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "export.json")
    parser.add_argument("--smoke", action="store_true", help=common.HELP)
    args = parser.parse_args()
    overrides = [
        *TRAINING,
        *GATE_OFF,
        f"threads={args.threads}",
        f"train.iterations={args.iterations}",
        "eval.num_prompts=16",
    ]
    if args.smoke:
        smoke = common.output_folder("export")
        args.work, args.out = smoke / "project", smoke / "export.json"
        args.chats, args.max_new_tokens, args.types = 2, 6, ["f16"]
        source = str(smoke_chat_model(smoke / "tiny"))
        overrides += [*SMOKE_TRAINING, *GATE_OFF]
    else:
        source = str(smollm2_gguf())
    result = run(args, source, [*overrides, *args.set])
    result["machine"] = common.machine()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print_table(result)
    print(f"results in {args.out}")


def run(args, source: str, overrides: list[str]) -> dict:
    from bench import common
    from flows import stages
    from ppo_core.config import load_config

    config = common.start_chat_project(args.work, common.chat_prompts(200), source, overrides)
    stages.train(config, show_progress=True)
    stages.evaluate(config)
    promotion = stages.promote(config)
    if promotion["decision"] != "promoted":
        raise SystemExit(f"the candidate was not promoted: {promotion['reasons']}")
    version = promotion["version"]
    chats = held_out_chats(config, args.chats)
    reference = transformers_side(config, version, chats, args.max_new_tokens)
    types = {}
    for file_type in args.types:
        settings = load_config(overrides=[*overrides, f"export.type={file_type}"])
        started = time.perf_counter()
        record = stages.export(settings)
        export_s = time.perf_counter() - started
        path = Path(settings.export.dir) / record["file"]
        row = {"bytes": record["bytes"], "tensor_types": record["tensor_types"]}
        row["export_s"] = export_s
        llama = llama_side(path, chats, reference, args)
        if llama is not None:
            row.update(agreement(reference, llama))
        types[file_type] = row
        print(json.dumps({file_type: row}), flush=True)
    return {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF) + LoRA PPO"
        if not args.smoke
        else "tiny default (smoke)",
        "version": version,
        "iterations": args.iterations,
        "chats": len(chats),
        "max_new_tokens": args.max_new_tokens,
        "threads": args.threads,
        "transformers_tokens_per_s": reference["tokens_per_s"],
        "llama_cpp": "run"
        if LLAMA_PYTHON.exists()
        else "not installed (bench/peers/setup_llama_cpp.sh)",
        "types": types,
        "settings": overrides,
    }


def held_out_chats(config, count: int) -> list[list[dict]]:
    """The first ``count`` chats of the held-out split."""
    from ppo_core.prompts import load_prompts

    return [row for row in load_prompts(config.data.eval_file)][:count]


def transformers_side(config, version: str, chats, max_new_tokens: int) -> dict:
    """Greedy continuations of ``chats`` by the promoted version, as the pipeline loads it."""
    import torch

    from ppo_core.models.causal_lm import load_tokenizer
    from ppo_core.models.generation import prompt_token_ids, stop_token_ids
    from ppo_core.models.policy import load_causal_lm

    folder = Path(config.promote.production_dir) / version
    torch.set_num_threads(config.threads)
    model, tokenizer = load_causal_lm(folder), load_tokenizer(folder)
    stops = stop_token_ids(model, tokenizer)
    rows, generated, elapsed = [], 0, 0.0
    for ids in prompt_token_ids(tokenizer, chats):
        started = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                eos_token_id=stops,
                pad_token_id=tokenizer.pad_token_id,
            )
        elapsed += time.perf_counter() - started
        greedy = out[0, len(ids) :].tolist()
        generated += len(greedy)
        rows.append({"prompt_ids": ids, "greedy": greedy})
    return {"chats": rows, "stop_ids": stops, "tokens_per_s": generated / elapsed}


def llama_side(path: Path, chats, reference: dict, args) -> dict | None:
    """llama.cpp's run of the file (``bench/peers/_llama_side.py``), or None where it is not
    installed."""
    if not LLAMA_PYTHON.exists():
        print(
            "llama.cpp side skipped: bench/.llama-venv is missing (bash bench/peers/setup_llama_cpp.sh)"
        )
        return None
    request = path.with_suffix(".request.json")
    request.write_text(
        json.dumps(
            {
                "chats": chats,
                "max_new_tokens": args.max_new_tokens,
                "stop_ids": reference["stop_ids"],
                "threads": args.threads,
            }
        )
    )
    done = subprocess.run(
        [
            str(LLAMA_PYTHON),
            str(ROOT / "bench" / "peers" / "_llama_side.py"),
            str(path),
            str(request),
        ],
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
    )
    request.unlink()
    if done.returncode != 0:
        raise SystemExit(f"llama.cpp side failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def agreement(reference: dict, llama: dict) -> dict:
    """Per chat: whether llama.cpp's prompt ids are the pipeline's, and how many greedy tokens
    agree before the first difference (all of them when none)."""
    chats = []
    for ours, theirs in zip(reference["chats"], llama["chats"], strict=True):
        same = 0
        for a, b in zip(ours["greedy"], theirs["greedy"], strict=False):
            if a != b:
                break
            same += 1
        chats.append(
            {
                "prompt_ids_equal": ours["prompt_ids"] == theirs["prompt_ids"],
                "tokens": len(ours["greedy"]),
                "agree": same,
                "identical": ours["greedy"] == theirs["greedy"],
            }
        )
    return {
        "load_s": llama["load_s"],
        "llama_tokens_per_s": llama["tokens_per_s"],
        "prompts_equal": sum(c["prompt_ids_equal"] for c in chats),
        "identical": sum(c["identical"] for c in chats),
        "agreeing_tokens": sum(c["agree"] for c in chats),
        "tokens": sum(c["tokens"] for c in chats),
        "chats": chats,
        "llama_cpp_python": llama["llama_cpp_python"],
    }


def print_table(result: dict) -> None:
    print(f"transformers: {result['transformers_tokens_per_s']:.1f} tokens/s")
    print("type   MB      export s  load s  tokens/s  prompts equal  identical  agreeing tokens")
    for name, row in result["types"].items():
        if "load_s" not in row:
            print(f"{name:6} {row['bytes'] / 1e6:7.1f} {row['export_s']:8.1f}   (no llama.cpp)")
            continue
        print(
            f"{name:6} {row['bytes'] / 1e6:7.1f} {row['export_s']:8.1f} {row['load_s']:7.2f} "
            f"{row['llama_tokens_per_s']:9.1f}  {row['prompts_equal']:>6}/{result['chats']:<6} "
            f"{row['identical']:>4}/{result['chats']:<5} {row['agreeing_tokens']:>6}/{row['tokens']}"
        )


if __name__ == "__main__":
    main()
