"""The model registry (layer 3): versions, promotion and rollback, and each version's lineage."""
