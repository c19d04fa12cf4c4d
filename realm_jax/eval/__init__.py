"""Evaluation: answer normalisation and matching, retrieval recall."""
