"""What a real model learns: the SmolLM2 recipe, generations of scheduled retraining, the feedback loop, the advantage estimators, the tiny default's quality."""
