"""How fast, and how much memory: iterations, generation, sampling with LoRA, micro-batches, data parallelism, sharding, precision, the orchestration's overhead."""
