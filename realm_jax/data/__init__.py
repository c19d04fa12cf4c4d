"""Corpora and datasets."""
