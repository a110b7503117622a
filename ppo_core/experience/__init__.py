"""Experience (layer 3): sampling responses, scoring them, and the models that judge them (the
KL reference and the reward), shared by training and evaluation so that both see the same
prompts, positions, sampling distribution, reference and reward (docs/design.md section 8).
Training and evaluation import from here; neither imports the other."""
