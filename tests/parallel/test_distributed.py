"""Who writes under torchrun: rank 0, or a process started alone."""

from __future__ import annotations

from ppo_core.parallel.process_group import is_main_process


def test_rank_zero_or_a_lone_process_is_the_main_one(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert is_main_process()
    monkeypatch.setenv("RANK", "0")
    assert is_main_process()
    monkeypatch.setenv("RANK", "1")
    assert not is_main_process()
