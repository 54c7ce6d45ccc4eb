"""moelab: an open laboratory for training Mixture-of-Experts language models in JAX."""

__version__ = "0.1.0"
