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

# node id -> seconds (setup, call and teardown) in a fresh clone's `make test` of ae6e27d on a
# 2-core AMD EPYC with AVX-512, three workers (2026-12-07; bench/speed/suite_time.py reads the
# log), the tests of 20 s or more
SECONDS = {
    "tests/flows/test_work_pool.py::test_a_worker_runs_the_deployments_and_ingest_triggers_retraining": 248.0,
    "tests/flows/test_flow.py::test_a_first_run_then_retraining_from_production_then_bad_data_stopping_at_validation": 232.0,
    "tests/flows/test_feedback_deployment.py::test_feedback_ingests_retrain_the_reward_and_ppo_trains_on_the_winner": 216.0,
    "tests/flows/test_worker_crash.py::test_a_run_whose_worker_died_is_started_again_and_resumes": 180.0,
    "tests/flows/test_doc_feedback.py::test_the_documented_feedback_block_runs_verbatim": 135.0,
    "tests/flows/test_deployment.py::test_deployment_run_reaches_the_served_flow": 124.0,
    "tests/training/test_default_quality.py::test_default_run_makes_reviews_positive_within_budget": 112.0,
    "tests/reliability/test_kill_loop.py::test_sigkill_at_random_points_then_resume_ends_like_an_uninterrupted_run": 104.0,
    "tests/flows/test_generations.py::test_two_generations_chain_and_every_version_stays_loadable[lora]": 96.0,
    "tests/base_sources/test_gguf_import.py::test_the_imported_smollm2_is_transformers_gguf_model_with_its_chat_template": 93.0,
    "tests/flows/test_export.py::test_a_lora_version_exports_to_the_greedy_tokens_of_the_promoted_version[tiny-llama]": 88.0,
    "tests/flows/test_doc_estimators.py::test_the_documented_estimators_block_runs_verbatim": 85.0,
    "tests/flows/test_notifications.py::test_a_rejected_a_failed_and_a_crashed_run_reach_the_webhook": 75.0,
    "tests/flows/test_dvc_pipeline.py::test_repro_then_nothing_then_only_what_a_param_touches": 72.0,
    "tests/experience/test_vllm_engine.py::test_a_ppo_run_on_the_engine_logs_the_gap_and_the_engine_ends_with_it": 63.0,
    "tests/flows/test_doc_own_model.py::test_the_documented_own_model_block_runs_verbatim": 61.0,
    "tests/flows/test_export.py::test_the_production_version_is_exported_recorded_and_never_replaced": 60.0,
    "tests/flows/test_doc_chat_lora.py::test_the_documented_chat_and_lora_block_runs_verbatim": 57.0,
    "tests/parallel/test_distributed_training.py::test_a_killed_fsdp_run_resumes_from_its_checkpoint_to_the_same_parameters": 55.0,
    "tests/flows/test_doc_answers.py::test_the_documented_answers_block_runs_verbatim": 51.0,
    "tests/test_bench_smoke.py::test_smoke_run[estimators.py]": 49.0,
    "tests/experience/test_vllm_engine.py::test_a_chat_model_whose_pad_is_its_stop_gets_only_sampled_stops": 48.0,
    "tests/test_bench_smoke.py::test_smoke_run[data_parallel.py]": 43.0,
    "tests/test_bench_smoke.py::test_smoke_run[engine.py]": 41.0,
    "tests/flows/test_generations.py::test_a_lora_version_promoted_before_bases_were_kept_survives_the_next_import": 37.0,
    "tests/test_bench_smoke.py::test_smoke_run[feedback_loop.py]": 36.0,
    "tests/experience/test_vllm_engine.py::test_each_ddp_rank_samples_with_an_engine_of_its_own": 36.0,
    "tests/test_bench_smoke.py::test_smoke_run[memory_scaling.py]": 34.0,
    "tests/test_bench_smoke.py::test_smoke_run[sharding.py]": 34.0,
    "tests/experience/test_vllm_engine.py::test_killing_the_stage_ends_its_engine": 33.0,
    "tests/test_bench_smoke.py::test_smoke_run[generations.py]": 29.0,
    "tests/reliability/test_retry_resumes.py::test_a_retried_train_stage_resumes_from_its_checkpoint": 29.0,
    "tests/reliability/test_fuzz_inputs.py::test_fuzzed_configs_load_or_name_the_wrong_key": 28.0,
    "tests/test_bench_smoke.py::test_smoke_run[ppo_vs_trl.py]": 28.0,
    "tests/test_bench_smoke.py::test_smoke_run[micro_batching.py]": 27.0,
    "tests/experience/test_vllm_engine.py::test_too_little_kv_cache_is_one_line_naming_the_keys": 26.0,
    "tests/experience/test_vllm_engine.py::test_the_engine_samples_the_loops_tokens_with_the_policys_weights": 25.0,
    "tests/test_bench_smoke.py::test_smoke_run[export.py]": 25.0,
    "tests/test_bench_smoke.py::test_smoke_run[grpo_vs_trl.py]": 23.0,
    "tests/test_bench_smoke.py::test_smoke_run[answers.py]": 23.0,
    "tests/test_bench_smoke.py::test_smoke_run[iteration_profile.py]": 23.0,
    "tests/experience/test_vllm_engine.py::test_the_engines_log_probabilities_with_values_computed_alone": 22.0,
    "tests/test_bench_smoke.py::test_smoke_run[few_rows.py]": 22.0,
    "tests/test_bench_smoke.py::test_smoke_run[real_model.py]": 22.0,
    "tests/parallel/test_distributed_training.py::test_two_nodes_on_loopback_run_the_documented_torchrun_command": 22.0,
    "tests/flows/test_restarts.py::test_a_restart_after_too_many_crashes_stops_and_says_what_to_do": 21.0,
    "tests/reliability/test_bounded_inputs.py::test_fuzzed_references_resolve_exactly_or_are_refused_naming_a_key": 21.0,
    # added since (measured alone on a busy machine, 2026-12-07)
    "tests/flows/test_doc_tasks.py::test_the_documented_reasoning_gym_block_runs_verbatim": 70.0,
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
