"""The vLLM engine's own process (run by the engine environment's Python, not the project's).

``generation.engine=vllm`` samples rollouts and evaluation replies with vLLM. vLLM pins a
transformers older than the project's lock, so it lives in an environment of its own
(``.venv-vllm``, ``make setup-vllm``) and this file is the whole of what runs there: it imports
only the standard library, torch, safetensors and vLLM, never ``ppo_core``. The stage starts it
(:mod:`ppo_core.experience.engines`), talks to it over a Unix socket
(``multiprocessing.connection``, the worker listening, authenticated with a key passed in the environment), and ends
it when the stage ends; it also ends itself when its parent dies (``PR_SET_PDEATHSIG``) or the
socket closes.

Requests (dicts) and answers:

- ``{"op": "load", "path": FILE}``: the weights in the safetensors ``FILE`` (the policy's,
  Hugging Face names, LoRA merged) loaded into the running model in place (vLLM's ``reload_weights``); answers the number
  of tensors loaded. Prefix caching is off, so no cached key or value outlives a load.
- ``{"op": "sample", "prompts": [[ids]], "seeds": [int], ...}``: one response per prompt
  (``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``stop_ids``); each row's draw is
  seeded by its own seed, so a run repeats on one machine. Answers ``{"tokens": [[ids]],
  "logprobs": [[float]], "finish": [str], "prompts": [[ids]]}``: the sampled ids (a stop id
  included), each one's log-probability as vLLM computed it (``logprobs_mode``), why each row
  ended (vLLM's ``finish_reason``: ``"stop"`` at a stop id, ``"length"`` at ``max_new_tokens``
  or at the end of the engine's context), and the prompt ids vLLM saw. Nothing is padded: a
  row is what was sampled.
- ``{"op": "stop"}``: the process exits.

Every answer is ``{"ok": ...}`` or ``{"error": "one line"}``.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time
import traceback
from multiprocessing.connection import Listener


def _die_with_parent() -> None:
    # Linux: SIGKILL this process when the stage that started it dies, however it dies.
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except OSError:
        pass
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def _engine(settings: dict):
    from vllm import LLM

    return LLM(
        model=settings["model"],
        dtype=settings["dtype"],
        seed=settings["seed"],
        max_model_len=settings["max_model_len"],
        enforce_eager=settings["enforce_eager"],
        enable_prefix_caching=False,
        # every prompt computed in one step: a prompt cut over two steps makes vLLM rewind the
        # row's seeded generator, which a CPU generator cannot ("CPU Generator does not use
        # offset": the recipe's evaluation, 128 chats; a test's 400 rows of 40 tokens)
        enable_chunked_prefill=False,
        max_num_batched_tokens=max(settings["max_model_len"], 8192),
        logprobs_mode=settings["logprobs_mode"],
        gpu_memory_utilization=settings["gpu_memory_utilization"],
        max_num_seqs=settings["max_num_seqs"],
    )


def _load(llm, path: str) -> int:
    from safetensors.torch import load_file

    weights = load_file(path)
    before = llm.apply_model(lambda model: dict(model.named_parameters(remove_duplicate=False)))[0]
    # vLLM's in-place reload: the CPU and GPU kernels' processed copies of the weights are
    # rebuilt from these, which a model's plain ``load_weights`` after start-up does not do
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights.items())})
    llm.apply_model(lambda model: _retie(model, before))
    return len(weights)


def _retie(model, before: dict) -> None:
    """Parameters that were one (a tied output layer and input embedding) are one again, and
    each layer holding one has its kernel's copy rebuilt: the reload processes the layer the
    weight was loaded through and skips the other (on a CPU the output layer kept multiplying
    by the embedding's old values: 0.56 in a log-probability, measured)."""
    groups: dict[int, list[str]] = {}
    for name, parameter in before.items():
        groups.setdefault(id(parameter), []).append(name)
    now = dict(model.named_parameters(remove_duplicate=False))
    for names in (names for names in groups.values() if len(names) > 1):
        renewed = next((now[name] for name in names if now[name] is not before[name]), None)
        for name in names:
            owner_name, _, attribute = name.rpartition(".")
            owner = model.get_submodule(owner_name)
            if renewed is not None and now[name] is not renewed:
                setattr(owner, attribute, renewed)
            method = getattr(owner, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(owner)


def _sample(llm, request: dict) -> dict:
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": ids} for ids in request["prompts"]]
    params = [
        SamplingParams(
            n=1,
            temperature=request["temperature"],
            top_k=request["top_k"],
            top_p=request["top_p"],
            max_tokens=request["max_new_tokens"],
            stop_token_ids=request["stop_ids"],
            ignore_eos=True,  # the stop ids above are the whole list (the pipeline's)
            seed=seed,
            logprobs=0,
            detokenize=False,
        )
        for seed in request["seeds"]
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    tokens, logprobs, finish, seen = [], [], [], []
    for output in outputs:
        seen.append(list(output.prompt_token_ids or ()))
        completion = output.outputs[0]
        ids = list(completion.token_ids)
        tokens.append(ids)
        finish.append(str(completion.finish_reason))
        logprobs.append(
            [
                float(step[token].logprob)
                for step, token in zip(completion.logprobs, ids, strict=True)
            ]
        )
    return {"tokens": tokens, "logprobs": logprobs, "finish": finish, "prompts": seen}


def main() -> int:
    _die_with_parent()
    settings = json.loads(os.environ["PPO_VLLM_SETTINGS"])
    key = bytes.fromhex(os.environ.pop("PPO_VLLM_KEY"))
    with Listener(settings["address"], family="AF_UNIX", authkey=key) as listener:
        connection = listener.accept()  # the stage that started this process, alone
    started = time.perf_counter()
    try:
        llm = _engine(settings)
    except BaseException as error:  # any failure to start is the stage's to report
        connection.send({"error": _one_line("the engine did not start", error)})
        return 1
    connection.send({"ok": {"start_seconds": time.perf_counter() - started}})
    while True:
        try:
            request = connection.recv()
        except (EOFError, OSError):
            return 0  # the stage has gone
        if request.get("op") == "stop":
            connection.send({"ok": True})
            return 0
        answer: dict
        try:
            if request["op"] == "load":
                answer = {"ok": _load(llm, request["path"])}
            elif request["op"] == "sample":
                answer = {"ok": _sample(llm, request)}
            else:
                answer = {"error": f"unknown request {request.get('op')!r}"}
        except BaseException as error:  # the stage reports it in one line
            traceback.print_exc(file=sys.stderr)
            answer = {"error": _one_line(f"{request.get('op')} failed", error)}
        connection.send(answer)


def _one_line(what: str, error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return f"{what}: {type(error).__name__}: {text[:500]}"


if __name__ == "__main__":
    sys.exit(main())
