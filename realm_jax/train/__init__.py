"""Training: REALM pre-training (step, candidates, index refresh), ICT, open-QA fine-tuning."""
