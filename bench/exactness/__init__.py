"""Is the update exact? The micro-batched gradient against one full pass, and a bf16 reference."""
