"""Test-wide settings."""

import os

import torch
from hypothesis import settings

# Tiny models run fastest on one thread, and a second process on the same cores (a parallel
# build, a DDP test) no longer makes OpenMP threads spin against each other.
torch.set_num_threads(int(os.environ.get("PPO_TEST_THREADS", "1")))

settings.register_profile("ci", deadline=None, print_blob=True)
settings.load_profile("ci")
