"""Corpus embedding and maximum-inner-product search."""
