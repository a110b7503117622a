"""Few-row products in the layout measured fastest (``ppo_core.models.few_rows``): the same
numbers to float rounding, narrow layers untouched, and a table kept per machine."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from ppo_core.models import few_rows
from ppo_core.models.sampling import sample_tokens


@pytest.fixture
def layouts(monkeypatch, tmp_path):
    """``layouts(transposed)``: every measurement answers ``transposed``, into an empty table
    kept under ``tmp_path``; the calls measured are recorded."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(few_rows, "_TABLE", {})
    monkeypatch.setattr(few_rows, "_LOADED", set())
    measured: list[tuple] = []

    def answer(transposed: bool):
        def measure(*shape):
            measured.append(shape)
            return transposed

        monkeypatch.setattr(few_rows, "_measure", measure)
        few_rows._TABLE.clear()
        return measured

    return answer


def test_a_wide_layer_computes_the_same_in_either_layout(layouts):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(576, 1536),
        nn.ReLU(),
        nn.Linear(1536, 576),
        nn.Linear(576, 128),
        nn.Linear(128, 64),
    )
    x = torch.randn(2, 4, 576)  # 8 rows
    expected = model(x)
    measured = layouts(True)
    with few_rows.few_row_products(model):
        assert "forward" in vars(model[0]) and "forward" not in vars(model[4])  # 128: untouched
        transposed = model(x)
        model(torch.randn(3, 576))  # 3 rows: the bucket of 4
        model(torch.randn(65, 576))  # 65 rows: F.linear, nothing measured
    assert not any("forward" in vars(m) for m in model.modules())  # restored
    # another summation order: measured 7.1e-7 of the largest output here
    difference = (transposed - expected).abs().max() / expected.abs().max()
    assert 0 < difference <= 2e-6, difference
    assert sorted(set(measured)) == [
        (576, 128, 4, torch.float32),
        (576, 128, 8, torch.float32),
        (576, 1536, 4, torch.float32),
        (576, 1536, 8, torch.float32),
        (1536, 576, 4, torch.float32),
        (1536, 576, 8, torch.float32),
    ]
    layouts(False)
    with few_rows.few_row_products(model):
        assert torch.equal(model(x), expected)  # F.linear kept: bit for bit


def test_the_table_is_kept_per_machine_and_read_back(layouts):
    model = nn.Linear(256, 256)
    measured = layouts(True)
    with few_rows.few_row_products(model):
        model(torch.randn(16, 256))
    stored = json.loads(few_rows.table_path().read_text())
    assert list(stored.values()) == [True] and len(measured) == 1
    assert torch.backends.cpu.get_cpu_capability() in few_rows.table_path().name
    few_rows._TABLE.clear()
    few_rows._LOADED.clear()
    measured.clear()
    with few_rows.few_row_products(model):
        model(torch.randn(16, 256))
    assert measured == []  # read from the file, not measured again


def test_the_measurement_compares_the_two_layouts():
    """The real timing, on one small shape: it answers, and takes no time worth noting."""
    assert few_rows._measure(256, 256, 8, torch.float32) in (True, False)


def test_the_measurement_reads_every_weight_from_memory(tmp_path, monkeypatch):
    """The copies a measurement sweeps outgrow every cache the CPU reports (twice the largest),
    so that it times the layouts on weights read from memory, as the loop meets them (timed on
    one cached weight, the choices flipped between runs on an AMD EPYC)."""
    for index, size in enumerate(["48K", "1024K", "256M", "\n"]):  # the last unreadable
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    assert few_rows.cold_bytes(tmp_path) == 512 << 20
    assert few_rows.cold_bytes(tmp_path / "none") == 64 << 20  # nothing reported: 64 MiB
    assert few_rows.cold_bytes() >= 64 << 20
    # a measurement multiplies by as many copies as fill cold_bytes, each once a sweep
    weight_bytes = 256 * 256 * 4
    monkeypatch.setattr(few_rows, "cold_bytes", lambda: 5 * weight_bytes)
    seen: list[int] = []
    product = few_rows._transposed_product
    monkeypatch.setattr(
        few_rows, "_transposed_product", lambda w, x: seen.append(w.data_ptr()) or product(w, x)
    )
    few_rows._measure(256, 256, 8, torch.float32, repeats=2)
    assert len(seen) == 5 * 3 and len(set(seen)) == 5  # 5 copies; a warm-up sweep and 2 timed


def test_a_transposed_product_comes_back_row_major(layouts):
    """What follows a layer (norms, activations, the next product) gets row-major memory: left
    as a transposed view, the loop on SmolLM2 ran no faster (1.00x against 1.31x)."""
    layer = nn.Linear(256, 512)
    layouts(True)
    x = torch.randn(16, 256)
    with few_rows.few_row_products(layer):
        out = layer(x)
    assert out.is_contiguous()
    torch.testing.assert_close(out, nn.functional.linear(x, layer.weight, layer.bias))


def test_sampling_draws_the_same_tokens_in_either_layout(layouts):
    """A 256-wide Llama (2 layers): 12 rows sampled with every few-row product transposed and
    with none; the same tokens, log-probabilities within float rounding (measured 0.0 on an
    AMD EPYC's MKL at 12 rows since the product comes back row-major; 1.1e-5 before)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama",
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    prompt_ids = torch.randint(3, 512, (12, 6))
    prompt_mask = torch.ones_like(prompt_ids)
    runs = []
    for transposed in (True, False):
        measured = layouts(transposed)
        torch.manual_seed(5)
        with few_rows.few_row_products(model):
            runs.append(
                sample_tokens(
                    model,
                    prompt_ids,
                    prompt_mask,
                    max_new_tokens=12,
                    stop_ids=[2],
                    pad_token_id=0,
                )
            )
        assert measured  # the loop's products went through the table
    (ids, logprobs, _), (plain_ids, plain_logprobs, _) = runs
    assert torch.equal(ids, plain_ids)
    difference = float((logprobs - plain_logprobs).abs().max())
    assert difference <= 2e-5, difference


def test_a_fifo_or_a_link_at_the_tables_path_is_neither_read_nor_written_through(layouts, tmp_path):
    """A FIFO at the table's path would block a reader for ever (the run hung): it is passed
    over and the layouts measured again; a link there is not followed, and the table is
    written as a new file in its place (the link's target untouched). Seen failing: the read
    blocked on the FIFO."""
    import os
    import threading

    path = few_rows.table_path()
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    done = threading.Event()
    threading.Thread(target=lambda: (few_rows._load(path), done.set()), daemon=True).start()
    assert done.wait(10), "reading the table blocked on a FIFO"
    os.unlink(path)
    target = tmp_path / "elsewhere.json"
    target.write_text('{"planted": true}')
    path.symlink_to(target)
    few_rows._LOADED.clear()
    few_rows._load(path)
    assert "planted" not in few_rows._TABLE
    few_rows._TABLE["576x1536x1 float32"] = True
    few_rows._save(path)
    assert not path.is_symlink() and json.loads(path.read_text()) == few_rows._TABLE
    assert target.read_text() == '{"planted": true}'
