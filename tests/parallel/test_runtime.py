"""bf16 on a CPU: measured against fp32 before a run, with a warning where it is the slower, and
``precision=auto``'s choice from the two rates and the model's width."""

import json
import warnings

import pytest
import torch

from ppo_core.config import load_config
from ppo_core.parallel import runtime as runtime_module
from ppo_core.parallel.runtime import (
    PrecisionChoice,
    PrecisionWarning,
    bf16_slowdown_message,
    choose_precision,
    matmul_gflops,
    model_width,
    setup_runtime,
)


def test_the_message_names_both_rates_and_what_to_do():
    message = bf16_slowdown_message(52.0, 0.9)
    assert "0.9 GFLOP/s against 52.0 for fp32" in message
    assert "use precision=fp32" in message
    assert bf16_slowdown_message(98.0, 215.0) is None


def test_the_rates_are_measured():
    assert matmul_gflops(torch.float32, size=64) > 0.0


@pytest.mark.parametrize(("bf16_rate", "warned"), [(1.0, True), (200.0, False)])
def test_a_bf16_run_on_the_cpu_warns_only_where_bf16_is_slower(monkeypatch, bf16_rate, warned):
    # the two rates stand for two kinds of CPU: without and with bf16 instructions
    rates = {torch.float32: 50.0, torch.bfloat16: bf16_rate}
    monkeypatch.setattr(runtime_module, "matmul_gflops", lambda dtype: rates[dtype])
    config = load_config(overrides=["precision=bf16", "device=cpu"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        setup_runtime(config, distributed=False)
    assert any(issubclass(w.category, PrecisionWarning) for w in caught) is warned
    with warnings.catch_warnings(record=True) as caught:  # auto (the default) never warns
        warnings.simplefilter("always")
        setup_runtime(load_config(overrides=["device=cpu"]), distributed=False)
    assert not any(issubclass(w.category, PrecisionWarning) for w in caught)


# Rates measured on three CPUs (GFLOP/s, fp32 and bf16): an AMD EPYC with AVX2 (bf16 emulated),
# an AVX-512 BF16 one at 2048x576x1536 (docs/benchmarks.md), an Intel Xeon with AMX.
AVX2, AVX512_BF16, AMX = (161.0, 0.3), (150.0, 392.0), (343.0, 3379.0)


@pytest.mark.parametrize(
    ("rates", "width", "chosen"),
    [
        (AVX2, 576, "fp32"),  # emulated bf16 would be 500x slower
        (AVX512_BF16, 576, "bf16"),  # SmolLM2-135M
        (AMX, 576, "bf16"),
        (AMX, 128, "fp32"),  # the tiny default: too narrow to pay
        (AMX, None, "fp32"),  # width unknown
        ((100.0, 140.0), 576, "fp32"),  # 1.4x: under the 1.5x margin
        ((100.0, 150.0), 576, "bf16"),  # at it
    ],
)
def test_auto_takes_bf16_where_it_pays(monkeypatch, rates, width, chosen):
    by_dtype = dict(zip((torch.float32, torch.bfloat16), rates, strict=True))
    monkeypatch.setattr(runtime_module, "matmul_gflops", lambda dtype: by_dtype[dtype])
    choice = choose_precision("auto", torch.device("cpu"), width)
    assert choice == PrecisionChoice("auto", chosen, rates[0], rates[1], width)
    assert choice.metrics() == {
        "perf/bf16": float(chosen == "bf16"),
        "perf/matmul_fp32_gflops": rates[0],
        "perf/matmul_bf16_gflops": rates[1],
    }
    # an explicit setting is taken as it is, whatever the rates
    assert choose_precision("fp32", torch.device("cpu"), width).precision == "fp32"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrecisionWarning)
        assert choose_precision("bf16", torch.device("cpu"), width).precision == "bf16"


@pytest.mark.parametrize("supported", [True, False])
def test_auto_on_a_gpu_asks_it_for_bf16(monkeypatch, supported):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: supported)
    choice = choose_precision("auto", torch.device("cuda"), 576)
    assert choice.precision == ("bf16" if supported else "fp32")
    assert choice.metrics() == {"perf/bf16": float(supported)}  # no CPU rates on a GPU
    assert choose_precision("auto", torch.device("cuda"), 64).precision == "fp32"


def test_the_width_is_read_from_a_model_or_an_adapter_folder(tmp_path, tiny_model_dir):
    assert (
        model_width(tiny_model_dir)
        == json.loads((tiny_model_dir / "config.json").read_text())["n_embd"]
    )
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        json.dumps({"base_model_name_or_path": str(tiny_model_dir)})
    )
    assert model_width(adapter) == model_width(tiny_model_dir)
    assert model_width(tmp_path / "missing") is None


def test_a_run_resolves_auto_on_this_machine_and_says_so():
    """The real measurement: auto is bf16 here exactly where the rates say it pays."""
    runtime = setup_runtime(
        load_config(overrides=["device=cpu"]), distributed=False, model_folder="x"
    )
    choice = runtime.chosen
    assert (
        choice.requested == "auto" and runtime.precision == choice.precision == "fp32"
    )  # no width
    assert choice.fp32_gflops > 0 and choice.bf16_gflops > 0
    assert "precision=auto -> fp32; matmul fp32" in choice.describe()
