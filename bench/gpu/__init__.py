"""On an accelerator: throughput and model FLOPs utilisation (run when a GPU is lent)."""
