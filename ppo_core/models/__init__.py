"""Model objects and their files (layer 2): the policy with its value head, weights, LoRA adapters,
scoring, generation and sampling, model folders, the tokenizer's vocabulary and GGUF export."""
