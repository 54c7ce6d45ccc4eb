"""Evaluations beyond the held-out loss: task evaluations scored by log-likelihood (``tasks``)."""
