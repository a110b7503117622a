"""The PPO run (layer 3): the loop (:mod:`ppo_core.training.loop`) and the steps it calls in
order, each in a module of its own: inputs, resume, models, state, seeds, rollout, the batch and
its plan (:mod:`ppo_core.training.batch`), the update."""
