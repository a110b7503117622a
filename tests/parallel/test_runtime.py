"""bf16 on a CPU: measured against fp32 before a run, with a warning where it is the slower."""

import warnings

import pytest
import torch

from ppo_core.config import load_config
from ppo_core.parallel import runtime as runtime_module
from ppo_core.parallel.runtime import (
    PrecisionWarning,
    bf16_slowdown_message,
    matmul_gflops,
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
    with warnings.catch_warnings(record=True) as caught:  # fp32 measures nothing
        warnings.simplefilter("always")
        setup_runtime(load_config(overrides=["device=cpu"]), distributed=False)
    assert not any(issubclass(w.category, PrecisionWarning) for w in caught)
