"""Corpus embedding, maximum-inner-product search and its recall@k."""
