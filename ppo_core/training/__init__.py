"""The steps the PPO run is made of (layer 3), each in a module of its own; the run itself,
which calls them in order, is :mod:`ppo_core.trainer`."""
