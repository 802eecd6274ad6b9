"""Sampling: logits of a step -> one token per sequence (greedy, temperature / top-k / top-p,
penalties, log-probabilities), also the target distribution speculative decoding accepts from.

Modules: :mod:`.sampler`.
"""
