"""Against the tools users compare with: TRL's PPOTrainer, and llama.cpp running the exported GGUF."""
