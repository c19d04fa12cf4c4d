"""Evaluation: open-QA EM and recall@k, the held-out report with baselines, the ask CLI."""
