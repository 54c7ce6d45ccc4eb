"""The MoE transformer: layers, routers, MoE dispatch and the language model."""

from moelab.model.transformer import count_params, forward, init_params, init_state, loss_fn

__all__ = ["count_params", "forward", "init_params", "init_state", "loss_fn"]
