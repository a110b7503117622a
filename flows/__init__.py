"""Orchestration: stage entry points (`ppo <stage>`), Prefect flows and deployments."""
