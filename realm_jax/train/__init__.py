"""Training: REALM pre-training (train step, candidates, index refresh, checkpoints) and ICT."""
