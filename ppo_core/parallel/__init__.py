"""Where and how a run computes (layer 3): device and threads, the torchrun process group, DDP and
FSDP."""
