"""Layer 1 of ppo_core: PPO math on tensors. Imports torch only (docs/design.md section 2).

Import each name from its module (``ppo_core.math.objective.PPOObjective``) or from the package
``ppo_core``; this package imports nothing, so that a process which only checks a config
(``ppo_core.math.declarations``) never imports torch."""
