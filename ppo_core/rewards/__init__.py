"""Rewards (layer 2): the built-in scorers and loading a reward model or scorer named by the
config."""
