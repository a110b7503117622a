"""`train` on 2 gloo processes reaches the parameters of 1 process holding the whole batch."""

from __future__ import annotations

import json

import pytest
import torch

from ppo_core.config import load_config
from ppo_core.training.loop import train
from tests import dist_train_worker
from tests.helpers import (
    PARITY_SLOW_ATOL,
    adapter_parameters,
    assert_parity,
    free_port,
    max_relative_difference,
    parameters,
    spawn_ranks,
)


def overrides(folder, model, prompts, rollout: int, mini: int) -> list[str]:
    return [
        f"model.policy={model}",
        f"data.train_file={prompts[0]}",
        f"train.output_dir={folder / 'candidate'}",
        f"train.checkpoint_dir={folder / 'ckpt'}",
        f"ppo.rollout_batch_size={rollout}",
        f"ppo.mini_batch_size={mini}",
        "ppo.micro_batch_size=4",
        "ppo.generation_batch_size=4",
        "ppo.epochs=2",
        "generation.max_new_tokens=6",
        "train.iterations=1",
        "optim.name=sgd",
        "optim.lr=0.5",
        "threads=1",
    ]


def train_on_two_ranks(settings: list[str]) -> None:
    """``train`` with ``settings`` on 2 gloo processes (``tests/dist_train_worker.py``)."""
    spawn_ranks(dist_train_worker.run, 2, 2, free_port(), settings)


# One process holding the whole batch (16 rows, mini-batches of 8) is the reference of most
# tests below; each reference run is trained once per module, on first use.
LORA = ["model.lora.enabled=true", "model.lora.rank=4", "model.reward=tests.helpers:varied_reward"]
MOMENTUM = ["optim.momentum=0.9", "train.checkpoint_every=1"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from tests.helpers import build_tiny_causal_lm

    return build_tiny_causal_lm(tmp_path_factory.mktemp("llama") / "llama", family="llama")


@pytest.fixture(scope="module")
def valued_model(tmp_path_factory, tiny_model_dir):
    """The tiny default with a value head off zero (``value_head.safetensors`` in the folder
    is read as the starting head): values that differ from row to row from the first rollout."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoConfig

    folder = tmp_path_factory.mktemp("valued") / "policy"
    shutil.copytree(tiny_model_dir, folder)
    hidden = AutoConfig.from_pretrained(folder).hidden_size
    generator = torch.Generator().manual_seed(5)
    head = {
        "weight": 0.5 * torch.randn(1, hidden, generator=generator),
        "bias": torch.tensor([0.1]),
    }
    save_file(head, str(folder / "value_head.safetensors"))
    return folder


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_model_dir, prompt_files):
    """``one_process(model, *settings)``: the folder of one process's run of ``model`` with
    ``settings`` (after the common :func:`overrides`), trained on first use."""
    runs: dict[tuple[str, ...], object] = {}

    def run(model, *settings: str):
        key = (str(model), *settings)
        if key not in runs:
            folder = tmp_path_factory.mktemp("one-process")
            train(
                load_config(overrides=[*overrides(folder, model, prompt_files, 16, 8), *settings])
            )
            runs[key] = folder
        return runs[key]

    return run


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_reach_the_parameters_of_one_process(
    tmp_path, tiny_model_dir, prompt_files, one_process
):
    single = one_process(tiny_model_dir)
    double = tmp_path / "double"
    train_on_two_ranks(overrides(double, tiny_model_dir, prompt_files, 8, 4))
    one, two = parameters(single / "candidate"), parameters(double / "candidate")
    # Equal to float32 round-off: the ranks pad and reduce in another order (measured here: at
    # most 3.1e-7 absolute, on weights of magnitude up to 1.07, after 4 SGD steps of lr 0.5; an
    # earlier build measured 1.3e-6). The bound is about 10x the worst seen. Whitening the
    # advantages per rank instead of globally moves them by 2.3 (relative), for comparison.
    assert_parity(two, one)
    # and the run did move the weights, so the comparison means something
    from safetensors.torch import load_file

    base = load_file(str(tiny_model_dir / "model.safetensors"))
    assert max_relative_difference({k: one[k] for k in base}, base) > 1e-3


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    ("estimator", "strategy"),
    [(["grpo", "ppo.samples_per_prompt=4"], "ddp"), (["reinforce_pp"], "fsdp")],
)
def test_critic_free_estimators_on_two_ranks_match_one_process(
    tmp_path, tiny_model_dir, prompt_files, one_process, estimator, strategy
):
    """GRPO's groups of 4 consecutive rows lie whole on a rank, so their statistics are local;
    REINFORCE++ normalises its returns over both ranks' tokens. Either way 2 ranks reach the
    weights of one process holding the whole batch, and no value head is saved."""
    name, *extra = estimator
    settings = [f"ppo.advantage_estimator={name}", "model.critic=none", *extra]
    single = one_process(tiny_model_dir, *settings)
    double = tmp_path / "double"
    train_on_two_ranks(
        [
            *overrides(double, tiny_model_dir, prompt_files, 8, 4),
            *settings,
            f"parallel.strategy={strategy}",
        ]
    )
    one, two = parameters(single / "candidate"), parameters(double / "candidate")
    assert not (double / "candidate" / "value_head.safetensors").exists()
    assert one.keys() == two.keys()
    assert_parity(two, one)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    "micro", ["ppo.micro_batch_size=1", "ppo.micro_batch_size=4", "ppo.micro_batch_tokens=30"]
)
def test_two_fsdp_ranks_reach_the_parameters_of_one_process(
    tmp_path, tiny_model_dir, prompt_files, one_process, micro
):
    """FSDP2 shards every block and the root over 2 gloo ranks; its reduce-scatter must average
    like DDP (checked, not assumed: some torch/gloo builds sum), with unequal token counts per
    rank (responses of their own lengths) and micro-batches of 1 and 4 rows, or of a token
    budget, which cuts each rank's rows into as many micro-batches as their lengths need (the
    ranks agree on the most: FSDP's collectives need every rank in each pass); with
    micro-batches of 1 the reference is offloaded to CPU memory
    (``parallel.reference_offload``)."""
    single = one_process(tiny_model_dir)
    sharded = tmp_path / "fsdp"
    train_on_two_ranks(
        [
            *overrides(sharded, tiny_model_dir, prompt_files, 8, 4),
            "parallel.strategy=fsdp",
            micro,
            f"parallel.reference_offload={micro.endswith('size=1')}",
        ]
    )
    one, two = parameters(single / "candidate"), parameters(sharded / "candidate")
    assert one.keys() == two.keys()
    assert_parity(two, one)
    # the gathered candidate is an ordinary Hugging Face folder
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(sharded / "candidate").state_dict()
    for name, value in loaded.items():
        if name in two:
            torch.testing.assert_close(value, two[name], rtol=0, atol=0, msg=name)
    assert "lm_head.weight" in loaded  # tied to the embedding, restored by from_pretrained


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp_ranks_take_values_from_the_sampling_loop_like_one_process(
    tmp_path, valued_model, prompt_files, one_process
):
    """``ppo.old_logprobs=sampling`` on the shared value head: the sampling loop applies the
    root's value head as it samples, whole on each rank while FSDP2 holds the model unsharded
    for sampling; the parameters match one process doing the same. The policy starts with a
    value head off zero (``valued_model``), so one iteration's values matter, and both sides
    sample from the same weights: a second iteration would sample from weights that differ by
    the update's rounding, and a flipped token is not a fault (seen on an AVX-512 host)."""
    sampled = ["ppo.old_logprobs=sampling"]
    single = one_process(valued_model, *sampled)
    sharded = tmp_path / "fsdp"
    train_on_two_ranks(
        [
            *overrides(sharded, valued_model, prompt_files, 8, 4),
            "parallel.strategy=fsdp",
            *sampled,
        ]
    )
    one, two = parameters(single / "candidate"), parameters(sharded / "candidate")
    assert one.keys() == two.keys()
    assert_parity(two, one)
    from safetensors.torch import load_file

    start = load_file(str(valued_model / "value_head.safetensors"))["weight"]
    assert not torch.equal(one["value_head.weight"], start)  # the update moved the head


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("merge", [False, True])
def test_two_fsdp_ranks_train_a_lora_adapter_like_one_process(
    tmp_path, prompt_files, llama, one_process, merge
):
    """LoRA under FSDP: the frozen base and the adapter are sharded together, the reference is
    the policy with its adapter off, and the candidate is gathered into an adapter folder (or,
    with ``model.lora.merge``, merged weights) equal to one process's."""
    from safetensors.torch import load_file

    from ppo_core.models.policy import load_causal_lm

    single = one_process(llama, *LORA)
    sharded = tmp_path / "fsdp"
    train_on_two_ranks(
        [
            *overrides(sharded, llama, prompt_files, 8, 4),
            *LORA,
            f"model.lora.merge={merge}",
            "parallel.strategy=fsdp",
        ]
    )
    heads = [load_file(str(f / "candidate" / "value_head.safetensors")) for f in (single, sharded)]
    assert_parity(heads[1], heads[0])
    if merge:
        assert not (sharded / "candidate" / "adapter_config.json").exists()
        one = load_causal_lm(single / "candidate").state_dict()  # its adapter merged in
        two = load_file(str(sharded / "candidate" / "model.safetensors"))
        one = {name: one[name] for name in two}
    else:
        one, two = (
            load_file(str(f / "candidate" / "adapter_model.safetensors")) for f in (single, sharded)
        )
        assert one.keys() == two.keys() and any("lora_B" in name for name in one)
        assert (sharded / "candidate" / "adapter_base.json").is_file()
        assert max(two[name].abs().max() for name in two if "lora_B" in name) > 1e-4  # trained
    assert_parity(two, one)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    ("first_by", "lora"),
    [("fsdp", False), ("one process", False), ("fsdp", True), ("one process", True)],
)
def test_a_checkpoint_resumes_at_another_world_size_and_strategy(
    tmp_path, tiny_model_dir, prompt_files, llama, one_process, first_by, lora
):
    """2 FSDP ranks train one iteration and write a sharded (DCP) checkpoint, each rank its own
    shards, and one plain process resumes from it; or the reverse, the FSDP ranks then sharding
    a whole checkpoint's weights and momentum (with LoRA: an adapter checkpoint, which the rank
    that builds on the meta device must load too). Either way the run reaches the parameters of
    one process that ran both iterations (the same global batch)."""
    # SGD with momentum: its state (a momentum buffer per parameter) is sharded and restored
    # like AdamW's moments, and it is linear in the gradients, so fp32 round-off stays
    # round-off (AdamW divides round-off gradients by their own size and makes them lr-sized)
    # Greedy rollouts (top_k=1): the second iteration samples from weights that already differ
    # by round-off, and a draw that lands within that round-off of a boundary of the cumulative
    # distribution takes another token (measured: a draw 7.9e-7 from a boundary flipped one
    # token and moved wte by 0.037). The argmax flips only at a logit near-tie, far rarer.
    momentum = [*MOMENTUM, *(LORA if lora else []), "generation.top_k=1"]
    model = llama if lora else tiny_model_dir

    def run(folder, ranks: int, iterations: int) -> None:
        if ranks == 1:
            train(
                load_config(
                    overrides=[
                        *overrides(folder, model, prompt_files, 16, 8),
                        *momentum,
                        f"train.iterations={iterations}",
                    ]
                )
            )
            return
        settings = [
            *overrides(folder, model, prompt_files, 8, 4),
            *momentum,
            f"train.iterations={iterations}",
            "parallel.strategy=fsdp",
        ]
        train_on_two_ranks(settings)

    whole = one_process(model, *momentum, "train.iterations=2")
    resumed = tmp_path / "resumed"
    run(resumed, 2 if first_by == "fsdp" else 1, 1)
    written = resumed / "ckpt" / "step-000001"
    if first_by == "fsdp":  # sharded: each rank wrote its own shards, no whole weights
        shards = sorted(p.name for p in (written / "shards").glob("*.distcp"))
        assert shards == ["__0_0.distcp", "__1_0.distcp"]
        assert not list((written / "model").glob("*.safetensors"))
    else:
        assert not (written / "shards").exists()
    run(resumed, 1 if first_by == "fsdp" else 2, 2)
    summary = json.loads((resumed / "candidate" / "training_summary.json").read_text())
    assert summary["resumed_from"] == 1
    read = adapter_parameters if lora else parameters
    one, two = read(whole / "candidate"), read(resumed / "candidate")
    # fp32 round-off of the ranks' other reduction order, carried through a second iteration;
    # a checkpoint that lost the momentum, the KL coefficient or a shard is off by far more
    assert_parity(two, one, PARITY_SLOW_ATOL)


def test_fsdp_in_one_process_is_refused_by_key_before_anything_is_written(
    tmp_path, tiny_model_dir, prompt_files
):
    from ppo_core.config import ConfigError

    config = load_config(
        overrides=[
            *overrides(tmp_path, tiny_model_dir, prompt_files, 16, 8),
            "parallel.strategy=fsdp",
        ]
    )
    with pytest.raises(ConfigError, match="parallel.strategy=fsdp needs 2 or more processes"):
        train(config)
    assert not (tmp_path / "candidate").exists() and not (tmp_path / "ckpt").exists()


def test_the_fsdp_probe_tells_an_average_from_a_sum():
    """Every fsdp run checks that FSDP averages its gradient reduction (the probe runs in each
    2-rank fsdp test above, which pass only when it reports an average); here, what the probe's
    reading means, for 2 and 4 ranks contributing 1, 2, ..., R."""
    from ppo_core.parallel.strategies import reduction_kind

    assert reduction_kind(torch.full((1, 2), 1.5), 2) == "average"
    assert reduction_kind(torch.full((1, 2), 3.0), 2) == "sum"
    assert reduction_kind(torch.full((1, 4), 2.5), 4) == "average"
    assert reduction_kind(torch.full((1, 4), 10.0), 4) == "sum"
    assert reduction_kind(torch.tensor([[1.5, 3.0]]), 2) == "an unexpected value"


def test_fsdp_policies_and_a_model_without_blocks():
    """bf16 under FSDP gathers and computes in bf16 but reduces gradients in fp32; a model in
    which FSDP finds no transformer block to shard is refused by key, before any collective."""
    from ppo_core.parallel.process_group import DataParallel
    from ppo_core.parallel.strategies import FullyShardedStrategy, ShardingError

    two_ranks = DataParallel(rank=0, world_size=2)
    bf16 = FullyShardedStrategy(two_ranks, torch.device("cpu"), "bf16")._policies(offload=False)
    assert bf16["mp_policy"].param_dtype == torch.bfloat16
    assert bf16["mp_policy"].reduce_dtype == torch.float32
    fp32 = FullyShardedStrategy(two_ranks, torch.device("cpu"), "fp32")._policies(offload=True)
    assert "mp_policy" not in fp32 and type(fp32["offload_policy"]).__name__ == "CPUOffloadPolicy"
    with pytest.raises(ShardingError, match="parallel.strategy=fsdp: found no transformer blocks"):
        FullyShardedStrategy(two_ranks, torch.device("cpu"))._shard(torch.nn.Linear(2, 2))


def shard_on_two_ranks(model_dir, precision: str, tmp_path) -> list[dict]:
    """Each rank's record from ``tests/dist_train_worker.py:shard_a_model``."""
    out = tmp_path / "sharded.json"
    spawn_ranks(
        dist_train_worker.shard_a_model, 2, 2, free_port(), str(model_dir), precision, str(out)
    )
    return [json.loads(out.with_name(f"{out.name}.{rank}").read_text()) for rank in (0, 1)]


@pytest.fixture(scope="module")
def llama_on_two_fsdp_ranks(llama, tmp_path_factory) -> list[dict]:
    """The records of the tiny Llama sharded over 2 ranks in fp32 (:func:`shard_on_two_ranks`),
    which two tests read."""
    return shard_on_two_ranks(llama, "fp32", tmp_path_factory.mktemp("llama-shards"))


@pytest.mark.distributed
def test_a_model_sharded_from_rank_0_computes_its_own_logits_on_every_rank(
    llama_on_two_fsdp_ranks,
):
    """Under ``fsdp`` only rank 0 reads the weights; rank 1 builds a Llama's structure on the
    meta device and receives its shards and the buffers outside the state dict (the rotary
    frequencies), so both compute the logits of the unsharded model."""
    for rank, found in enumerate(llama_on_two_fsdp_ranks):
        assert found["logit_difference"] < 1e-5, (rank, found)
        assert set(found["computed"]) == {"torch.float32"}


@pytest.mark.distributed
def test_fsdp_blocks_are_sharded_again_after_sampling(llama_on_two_fsdp_ranks):
    """Sampling gathers the whole sharded policy once (``strategy.gathered``); after it every
    parameter is a shard again on every rank, and is one again after each of the update's next
    forward and backward passes (each block reshards after its forward pass once more). A policy left gathered would hold the whole model on every rank through
    the update: memory only, which no number a run computes would show."""
    for rank, found in enumerate(llama_on_two_fsdp_ranks):
        states = found["states"]
        count = states["before"]["shards"]
        assert count > 0 and states["before"]["whole"] == 0, (rank, states)
        assert states["during"] == {"shards": 0, "whole": count}, (rank, states)  # gathered
        assert states["after"] == states["before"], (rank, states)
        assert states["update_forward"] == states["before"], (rank, states)
        assert states["update_backward"] == states["before"], (rank, states)


@pytest.mark.distributed
def test_fsdp_in_bf16_computes_in_bf16_from_fp32_shards(tmp_path, tiny_model_dir):
    """``precision=bf16`` under ``fsdp``: FSDP2's mixed-precision policy gathers each block in
    bf16 for its passes while the shards the optimizer steps stay fp32."""
    for found in shard_on_two_ranks(tiny_model_dir, "bf16", tmp_path):
        assert found["computed"] and set(found["computed"]) == {"torch.bfloat16"}
        assert found["shard"] == "torch.float32"
        assert 0 < found["logit_difference"] < 0.5  # bf16 round-off, no more


@pytest.mark.distributed
@pytest.mark.slow
def test_two_nodes_on_loopback_run_the_documented_torchrun_command(
    tmp_path, tiny_model_dir, prompt_files, one_process
):
    """`torchrun --nnodes 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT` as docs/design.md
    gives it, as two "nodes" of one rank each on 127.0.0.1, with FSDP: the run reaches the
    parameters of one process holding the whole batch."""
    import subprocess
    import sys
    from pathlib import Path

    single = one_process(tiny_model_dir)
    nodes = tmp_path / "nodes"
    settings = [
        *overrides(nodes, tiny_model_dir, prompt_files, 8, 4),
        f"train.metrics_dir={nodes / 'metrics'}",
        "train.allow_stale_data=true",
        "parallel.strategy=fsdp",
    ]
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [
        str(torchrun),
        "--nnodes",
        "2",
        "--nproc_per_node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--rdzv-id",
        "loopback-test",
        "-m",
        "flows.cli",
        "train",
        "--config",
        "none",
        *settings,
    ]
    root = Path(__file__).resolve().parents[2]
    launched = [
        subprocess.Popen(
            command, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for _ in range(2)
    ]
    outputs = [process.communicate(timeout=600)[0] for process in launched]
    for process, output in zip(launched, outputs, strict=True):
        assert process.returncode == 0, output[-3000:]
    one, two = parameters(single / "candidate"), parameters(nodes / "candidate")
    assert_parity(two, one)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_killed_fsdp_run_resumes_from_its_checkpoint_to_the_same_parameters(
    tmp_path, tiny_model_dir, prompt_files
):
    """SIGKILL a 2-rank FSDP run (torchrun and both ranks, as a lost machine would end it) once
    it has written checkpoints: the rerun says it resumed from the newest one and ends at the
    parameters of a run that was never stopped."""
    import contextlib
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    import psutil

    def settings(folder: Path) -> list[str]:
        return [
            *overrides(folder, tiny_model_dir, prompt_files, 8, 4),
            f"train.metrics_dir={folder / 'metrics'}",
            "train.allow_stale_data=true",
            "train.iterations=12",
            "train.checkpoint_every=1",
            "parallel.strategy=fsdp",
        ]

    def command(folder: Path) -> list[str]:
        torchrun = Path(sys.executable).with_name("torchrun")
        return [str(torchrun), "--nproc_per_node", "2", "--master-port", str(free_port()),
                "-m", "flows.cli", "train", "--config", "none", *settings(folder)]  # fmt: skip

    root = Path(__file__).resolve().parents[2]

    def run(folder: Path) -> str:
        done = subprocess.run(
            command(folder), cwd=root, capture_output=True, text=True, timeout=600, check=False
        )
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        return done.stdout + done.stderr

    # the run never stopped: the same settings on two ranks, started the quick way
    train_on_two_ranks(settings(tmp_path / "whole"))
    killed = tmp_path / "killed"
    first = subprocess.Popen(
        command(killed),
        cwd=root,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    checkpoints = killed / "ckpt"
    deadline = time.monotonic() + 300
    while len(list(checkpoints.glob("step-*"))) < 2:
        assert first.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # the ranks run in sessions of their own (torch's elastic agent starts them so), so the
    # whole tree is killed, not torchrun's process group alone
    tree = [first.pid, *(child.pid for child in psutil.Process(first.pid).children(recursive=True))]
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    first.wait()
    newest = int(sorted(checkpoints.glob("step-*"))[-1].name.split("-")[1])
    output = run(killed)
    assert f"resumed at {newest})" in output, output[-3000:]
    assert 0 < newest < 12
    one, two = parameters(tmp_path / "whole" / "candidate"), parameters(killed / "candidate")
    assert_parity(two, one, PARITY_SLOW_ATOL)
