"""Turning ``model.reward`` into a reward function (layer 2).

A reward function maps ``(prompts, responses)`` (lists of equal length) to a float32 tensor
``[B]``. A response is its text up to EOS. A prompt is what the prompt file holds: a string for a
plain prompt, or for a chat the list of its turns (``{"role": ..., "content": ...}`` dicts, the
response being the assistant's next turn). Three sources:

- ``builtin:sentiment``: the VADER scorer of :mod:`ppo_core.rewards.scorers`;
  ``builtin:afinn``: the AFINN-165 lexicon scorer there (an independent check, ``promote.check_reward``).
- ``module:function``: a Python callable you name. **This imports and runs your code**; it is the
  only option that imports code named by configuration. The module is looked for in the working
  folder first (``my_module.py`` beside ``params.yaml``), then on ``PYTHONPATH`` and among the
  installed packages.
- a local folder of a Hugging Face sequence-classification model, or its hub id (``org/name``)
  when a snapshot of it is in the local Hugging Face cache (never downloaded): the score is the logit of a
  one-label model, or the log-odds of the last label against the first for a two-label one. It
  reads ``prompt + response`` re-tokenised with its own tokenizer; a chat is rendered by the
  reward model's chat template with the response as the assistant's turn (its turns' contents
  one a line when it has no template).

Whatever its source, one call of the reward may take at most ``timeout`` seconds
(``model.reward_timeout``); a call that takes longer is a :class:`RewardTimeoutError`, so that a
reward that hangs stops the run, and releases its lock, instead of blocking it for ever.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ppo_core.base_sources.hub_cache import HUB_ID, snapshot_of
from ppo_core.models.folders import check_model_folder
from ppo_core.prompts import Prompt
from ppo_core.rewards.classifier import (
    has_scalar_head,
    load_reward_classifier,
    padded,
    scored_token_ids,
    sequence_logits,
)
from ppo_core.rewards.scorers import BUILTIN_REWARDS

__all__ = [
    "RewardError",
    "RewardTimeoutError",
    "build_reward_fn",
    "checked_scores",
    "reference_keywords",
]

RewardFn = Callable[..., Tensor]
"""``reward(prompts, responses, references=None) -> scores [B]``: ``references`` maps each
reference field of the rows to its values, one a row."""


class RewardError(ValueError):
    """The reward source is unknown, cannot be loaded, or returned something unusable."""


class RewardTimeoutError(RewardError):
    """One call of the reward did not return within ``model.reward_timeout`` seconds."""


TIMEOUT_KEY = "model.reward_timeout"


def build_reward_fn(
    spec: str,
    device: torch.device | str = "cpu",
    trust_remote_code: bool = False,
    timeout: float = 0.0,
    key: str = "model.reward",
    code_free: Sequence[str] = (),
    normalization: tuple[float, float] | None = None,
    name: str | None = None,
    reference_fields: Sequence[str] = (),
) -> RewardFn:
    """The reward function described by ``spec`` (see the module docstring), which the setting
    ``key`` names; each call that takes longer than ``timeout`` seconds raises
    :class:`RewardTimeoutError` (0: no limit). A ``module:function`` whose top-level module lies
    in one of the folders ``code_free`` (model, data, checkpoint and report folders: what a
    run writes or a model brings) is refused before it is imported. ``normalization``
    (mean, std) standardises a reward model folder's scores; ``name`` is what errors call the
    reward (default ``spec``).

    A reward may take the prompt rows' reference fields (``reference_fields``: an ``answer``,
    ``tests``, ...) as keyword arguments, as TRL's GRPO rewards take dataset columns:
    ``def reward(prompts, responses, *, answer, **rest)``; its signature is read once, here,
    and a keyword it requires that the rows do not carry is a :class:`RewardError` naming it.
    A two-argument reward gets none of them."""
    callable_ = _reward_callable(spec, device, trust_remote_code, key, tuple(code_free))
    if normalization is not None:
        if not isinstance(callable_, _RewardModel):
            raise RewardError(f"{key}={spec!r}: only a reward model's scores are normalised")
        callable_.normalization = normalization
    wanted = reference_keywords(callable_, reference_fields, f"{key}={spec!r}")
    return _checked(callable_, name or spec, timeout, wanted)


def reference_keywords(
    function: Callable[..., Any], reference_fields: Sequence[str], where: str
) -> tuple[str, ...]:
    """The reference fields ``function`` takes beside ``(prompts, responses)``: each named
    parameter after the first two (all of ``reference_fields`` for a ``**kwargs``), in the
    order of ``reference_fields``. A required one the rows do not carry is a
    :class:`RewardError` naming it and the fields there are."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return ()  # a callable without a signature to read: the two-argument convention
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    rest = [p for p in parameters if p.kind != inspect.Parameter.VAR_POSITIONAL]
    rest = rest[2:] if len([p for p in rest[:2] if p.kind in positional]) == 2 else rest
    takes_any = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in rest)
    named = {p.name: p for p in rest if p.kind != inspect.Parameter.VAR_KEYWORD}
    missing = [
        name
        for name, parameter in named.items()
        if parameter.default is inspect.Parameter.empty and name not in reference_fields
    ]
    if missing:
        have = ", ".join(reference_fields) or "none"
        raise RewardError(
            f"{where} asks for the keyword {missing[0]!r}, which the prompt rows do not "
            f"carry (data.reference_fields: {have}); add it to the rows and to "
            "data.reference_fields, or give the parameter a default"
        )
    return tuple(field for field in reference_fields if takes_any or field in named)


def _reward_callable(
    spec: str,
    device: torch.device | str,
    trust_remote_code: bool,
    key: str,
    code_free: tuple[str, ...] = (),
) -> RewardFn:
    """The bare function named by ``spec``, before any check or time limit."""
    if spec in BUILTIN_REWARDS:
        try:
            return BUILTIN_REWARDS[spec]()
        except ImportError as exc:  # a built-in scorer's optional package is missing
            raise RewardError(f"{key}={spec!r}: {exc}") from None
    if spec.startswith("builtin:"):
        raise RewardError(
            f"{key}={spec!r} is not a built-in reward; the built-in ones are "
            f"{', '.join(BUILTIN_REWARDS)}"
        )
    if Path(spec).is_dir():
        return _RewardModel(spec, device, trust_remote_code)
    if ":" not in spec and HUB_ID.fullmatch(spec):
        return _RewardModel(str(snapshot_of(spec, key)), device, trust_remote_code)
    if ":" in spec:
        module_name, _, function_name = spec.partition(":")
        module = _import_reward_module(spec, module_name, key, code_free)
        function = getattr(module, function_name, None)
        if not callable(function):
            raise RewardError(f"{key}={spec!r}: {module_name} has no callable {function_name!r}")
        return function
    raise RewardError(
        f"{key}={spec!r} is neither a built-in reward ({', '.join(BUILTIN_REWARDS)}), a "
        "module:function, an existing folder of a sequence-classification model, nor a hub id "
        "in the local Hugging Face cache"
    )


def _import_reward_module(
    spec: str, module_name: str, key: str, code_free: tuple[str, ...] = ()
) -> Any:
    """Import ``module_name`` as Python would from the working folder: the working folder is
    searched first (as by ``python -c``), then the installed packages; never from the folders
    ``code_free`` (:func:`_refuse_code_from`)."""
    working_folder = str(Path.cwd())
    added = working_folder not in sys.path
    if added:
        sys.path.insert(0, working_folder)
    try:
        _refuse_code_from(spec, module_name, key, code_free)
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise RewardError(
            f"{key}={spec!r}: cannot import module {module_name!r} ({exc}); looked in the "
            f"working folder {working_folder} and the installed packages"
        ) from None
    finally:
        if added:
            sys.path.remove(working_folder)


def _refuse_code_from(spec: str, module_name: str, key: str, code_free: tuple[str, ...]) -> None:
    """:class:`RewardError` when the top-level package or module of ``module_name`` lies in one
    of the folders ``code_free``, or is a package folder holding one: found without running
    anything (``find_spec`` of a top-level name imports nothing). Otherwise
    ``models.candidate.check:score`` would run a file that a trained model folder brought."""
    if not code_free:
        return
    top = module_name.split(".")[0]
    try:
        found = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return  # the import below fails and says why
    if found is None:
        return
    package = found.submodule_search_locations is not None
    locations = list(found.submodule_search_locations or []) or [found.origin or ""]
    for location in filter(None, locations):
        real = os.path.realpath(location)
        for folder in code_free:
            root = os.path.realpath(folder)
            if _within(real, root) or (package and _within(root, real)):
                raise RewardError(
                    f"{key}={spec!r}: module {top!r} ({real}) is in or holds {folder!r}, a "
                    "folder of models, data, checkpoints or reports; a reward is code, and code "
                    "is never imported from there. Put it in a module of its own outside them"
                )


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _checked(
    function: Callable[..., Any], name: str, timeout: float = 0.0, wanted: Sequence[str] = ()
) -> RewardFn:
    """Wrap a reward function so that errors, bad outputs and calls longer than ``timeout``
    seconds (0: no limit) name it; the wrapper takes the batch's reference fields as
    ``references`` (``{field: [value per row]}``) and passes the ``wanted`` ones on as
    keywords."""

    def reward(
        prompts: list[Prompt],
        responses: list[str],
        references: Mapping[str, Sequence[Any]] | None = None,
    ) -> Tensor:
        given = references or {}
        absent = [field for field in wanted if field not in given]
        if absent:
            raise RewardError(
                f"the reward {name!r} takes the reference field {absent[0]!r}, which this "
                "batch does not carry"
            )
        keywords = {field: list(given[field]) for field in wanted}
        call = functools.partial(function, **keywords) if keywords else function
        try:
            if timeout > 0:
                raw = _call_with_timeout(call, prompts, responses, timeout, name)
            else:
                raw = call(prompts, responses)
        except RewardTimeoutError:
            raise
        except Exception as exc:
            raise RewardError(f"the reward {name!r} raised {type(exc).__name__}: {exc}") from exc
        return checked_scores(raw, len(prompts), name)

    reward.source = function  # type: ignore[attr-defined]  # what a report reads reasons from
    return reward


def _call_with_timeout(
    function: RewardFn, prompts: list[Prompt], responses: list[str], timeout: float, name: str
) -> object:
    """``function(prompts, responses)``, run in a daemon thread that the caller waits for at most
    ``timeout`` seconds; raises :class:`RewardTimeoutError` when it has not returned by then.

    Python cannot stop a running function from outside, so the watchdog stops *waiting*: the
    caller raises, the run unwinds (its lock is released, nothing more is written) and the
    process exits with the error while the hung call is abandoned. The thread is a daemon
    ``threading.Thread`` because the interpreter does not wait for daemon threads at exit; a
    ``ThreadPoolExecutor`` joins its workers at exit and would hang on the abandoned call.
    ``signal.alarm`` was not chosen: it can be set in the main thread of a Unix process only (a
    stage run from a task or test thread would have no watchdog, nor would Windows), and its
    handler runs only between Python bytecodes, so it cannot end a long C computation either.
    Neither way stops a call that holds the GIL and never releases it (a C loop, a regular
    expression that backtracks for minutes): the waiting thread cannot run until it returns.
    Only killing the process stops that, which is a supervisor's timeout's job.
    """
    outcome: list[object] = []
    failure: list[BaseException] = []
    done = threading.Event()
    # Grad mode and the current CUDA device are per thread in torch: the call sees the caller's.
    grad_enabled = torch.is_grad_enabled()
    cuda_device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

    def call() -> None:
        try:
            if cuda_device is not None:
                torch.cuda.set_device(cuda_device)
            with torch.set_grad_enabled(grad_enabled):
                outcome.append(function(prompts, responses))
        except BaseException as exc:  # handed to the caller, which decides what it means
            failure.append(exc)
        finally:
            done.set()

    threading.Thread(target=call, name=f"reward {name}", daemon=True).start()
    if not done.wait(timeout):
        raise RewardTimeoutError(
            f"the reward {name!r} did not return within {timeout:g} s ({TIMEOUT_KEY}="
            f"{timeout:g}) for a batch of {len(prompts)} responses; fix or speed up the reward, "
            f"or raise {TIMEOUT_KEY} (0 waits without limit)"
        )
    if failure:
        raise failure[0]
    return outcome[0]


def checked_scores(raw: object, expected: int, name: str = "reward") -> Tensor:
    """``raw`` as a float32 tensor ``[expected]`` of finite numbers, or a :class:`RewardError`
    naming the reward and what was wrong."""
    try:
        scores = torch.as_tensor(raw, dtype=torch.float32).detach().cpu()
    except (TypeError, ValueError, RuntimeError) as exc:
        raise RewardError(
            f"the reward {name!r} returned {type(raw).__name__}, not a sequence of numbers ({exc})"
        ) from None
    if scores.shape != (expected,):
        raise RewardError(
            f"the reward {name!r} returned shape {tuple(scores.shape)} for {expected} "
            "responses; it must return one number per response"
        )
    if not torch.isfinite(scores).all():
        bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
        raise RewardError(f"the reward {name!r} returned NaN or inf for responses {bad[:5]}")
    return scores


class _RewardModel:
    """A sequence-classification reward model from a local folder, its scores optionally
    standardised by ``normalization`` (the mean and standard deviation a reward version
    recorded on its reference set), so that PPO sees one scale whichever version scores."""

    def __init__(
        self,
        folder: str,
        device: torch.device | str,
        trust_remote_code: bool,
        normalization: tuple[float, float] | None = None,
    ):
        from transformers import AutoTokenizer

        path = check_model_folder(folder, "reward model")
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model: Any = load_reward_classifier(path, "reward model", trust_remote_code).to(device)
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device = device
        self.normalization = normalization

    @torch.no_grad()
    def __call__(self, prompts: list[Prompt], responses: list[str]) -> Tensor:
        rows = [
            scored_token_ids(self.tokenizer, p, r) for p, r in zip(prompts, responses, strict=True)
        ]
        limit = self.tokenizer.model_max_length
        if isinstance(limit, int) and 0 < limit < 1_000_000:
            rows = [row[:limit] for row in rows]
        input_ids, attention_mask = padded(rows, self.tokenizer.pad_token_id)
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        if has_scalar_head(self.model):
            # the score at the last real token, wherever the pad token id also occurs
            logits = sequence_logits(self.model, input_ids, attention_mask)
        else:
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
        scores = logits[:, 0] if logits.shape[-1] == 1 else logits[:, -1] - logits[:, 0]
        if self.normalization is not None:
            mean, std = self.normalization
            scores = (scores - mean) / std
        return scores.cpu()
