"""Test order for the pytest workers: the longest scenarios first, so that they run side by side
from the start and the many short tests fill the gaps at the end (longest-first scheduling).

`make test` distributes tests with ``--dist load --maxschedchunk 1``: after two tests each, a
worker gets the next test of the list whenever it is free, so the longest tests spread over the
workers and neither ends minutes after the other. (Without ``--maxschedchunk 1`` each worker
first gets a quarter of its share in one piece, and one worker got every long test.)

``SECONDS`` holds each long test's duration as last measured on a fresh clone (`make test`
prints the slowest with ``--durations``); a test marked ``slow`` that is not listed counts as
``UNLISTED_SLOW_S``; the others keep the order in which pytest collects them.
"""

from __future__ import annotations

import pytest

UNLISTED_SLOW_S = 20.0

# node id -> seconds of a whole `make test` in the working tree on two shared cores (2026-12-02)
SECONDS = {
    "tests/flows/test_work_pool.py::test_a_worker_runs_the_deployments_and_ingest_triggers_retraining": 210.0,
    "tests/flows/test_worker_crash.py::test_a_run_whose_worker_died_is_started_again_and_resumes": 147.0,
    "tests/flows/test_flow.py::test_a_first_run_then_retraining_from_production_then_bad_data_stopping_at_validation": 131.0,
    "tests/flows/test_deployment.py::test_deployment_run_reaches_the_served_flow": 101.0,
    "tests/test_bench_smoke.py::test_smoke_run[orchestration.py]": 98.0,
    "tests/training/test_default_quality.py::test_default_run_makes_reviews_positive_within_budget": 93.0,
    "tests/reliability/test_kill_loop.py::test_sigkill_at_random_points_then_resume_ends_like_an_uninterrupted_run": 69.0,
    "tests/flows/test_dvc_pipeline.py::test_repro_then_nothing_then_only_what_a_param_touches": 60.0,
    "tests/parallel/test_distributed_training.py::test_a_killed_fsdp_run_resumes_from_its_checkpoint_to_the_same_parameters": 51.0,
    "tests/flows/test_doc_own_model.py::test_the_documented_own_model_block_runs_verbatim": 40.0,
    "tests/flows/test_doc_chat_lora.py::test_the_documented_chat_and_lora_block_runs_verbatim": 34.0,
    "tests/flows/test_doc_estimators.py::test_the_documented_estimators_block_runs_verbatim": 34.0,
    "tests/base_sources/test_gguf_import.py::test_the_imported_smollm2_is_transformers_gguf_model_with_its_chat_template": 75.0,
    "tests/reliability/test_retry_resumes.py::test_a_retried_train_stage_resumes_from_its_checkpoint": 22.0,
    # measured alone on a busy machine (2026-12-03): upper bounds until the next fresh clone
    "tests/flows/test_generations.py::test_two_generations_chain_and_every_version_stays_loadable[lora]": 55.0,
    "tests/flows/test_generations.py::test_a_lora_version_promoted_before_bases_were_kept_survives_the_next_import": 40.0,
    "tests/flows/test_notifications.py::test_a_rejected_a_failed_and_a_crashed_run_reach_the_webhook": 35.0,
    # measured alone, idle machine (2026-12-04)
    "tests/flows/test_export.py::test_a_lora_version_exports_to_the_greedy_tokens_of_the_promoted_version[tiny-llama]": 170.0,
    "tests/flows/test_export.py::test_the_production_version_is_exported_recorded_and_never_replaced": 135.0,
    # measured alone on a busy machine (2026-12-06); a fresh clone's make test beside a
    # benchmark measured 319 s and 338 s
    "tests/flows/test_feedback_deployment.py::test_feedback_ingests_retrain_the_reward_and_ppo_trains_on_the_winner": 260.0,
    "tests/flows/test_doc_feedback.py::test_the_documented_feedback_block_runs_verbatim": 83.0,
}


def expected_seconds(item: pytest.Item) -> float:
    listed = SECONDS.get(item.nodeid, SECONDS.get(item.nodeid.split("[")[0]))
    if listed is not None:
        return listed
    return UNLISTED_SLOW_S if item.get_closest_marker("slow") else 0.0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A module's tests stay together, so that its module-scoped fixtures (a Prefect server, the
    # distributed tests' one-process references) are built once per worker; the modules go in
    # the order of their longest test, and inside one the longest go first. sorted() is stable:
    # the modules of short tests keep their collected order.
    longest: dict[str, float] = {}
    first: dict[str, int] = {}
    for index, item in enumerate(items):
        module = item.nodeid.split("::")[0]
        longest[module] = max(longest.get(module, 0.0), expected_seconds(item))
        first.setdefault(module, index)

    def order(item: pytest.Item) -> tuple[float, int, float]:
        module = item.nodeid.split("::")[0]
        return (-longest[module], first[module], -expected_seconds(item))

    items[:] = sorted(items, key=order)
