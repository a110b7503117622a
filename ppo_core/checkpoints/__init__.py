"""Training checkpoints (layer 2): atomic, checksummed folders, whole or sharded over ranks."""
