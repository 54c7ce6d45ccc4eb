"""moelab's architecture for Hugging Face transformers: the configuration (written by `moelab export hf`).

This file is copied into an exported model's directory and imported by transformers with
``trust_remote_code=True``; it needs only transformers, never moelab.
"""

from transformers import PretrainedConfig


class MoelabConfig(PretrainedConfig):
    model_type = "moelab"
    # a plain attribute: transformers 5 makes ``rope_scaling`` a deprecated alias of its own
    # ``rope_parameters`` (standardised and validated for its own RoPE kinds); this is moelab's
    rope_scaling = None

    def __init__(
        self,
        vocab_size: int = 2048,
        hidden_size: int = 128,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 4,
        head_dim: int = 32,
        layer_kv_heads: list | None = None,  # kv heads of each layer (local and global layers differ)
        layer_windows: list | None = None,  # each layer's sliding window; 0 = global (causal only)
        rope_fraction: float = 1.0,  # the first fraction of each head's dims is rotated (half-split pairs)
        rope_theta: float = 10000.0,
        # {"type": none|pi|ntk|yarn, "factor": s, "original_max_position_embeddings": L0}: the RoPE
        # frequencies for a context s times the trained L0 (modeling_moelab.rope_frequencies)
        rope_scaling: dict | None = None,
        rms_norm_eps: float = 1e-6,
        n_routed_experts: int = 8,
        num_experts_per_tok: int = 2,
        moe_intermediate_size: int = 64,
        latent_dim: int = 0,  # routed experts work in this width (down-projected, normed, up-projected); 0 = none
        shared_intermediate_size: int = 0,  # the shared experts side by side as one SwiGLU; 0 = none
        router: str = "softmax",  # softmax or sigmoid scores; top-k on logits + bias, gates renormalised
        routed_scale: float = 1.0,  # the routed gates of a token sum to this (sigmoid router; 1 for softmax)
        max_position_embeddings: int = 128,
        tie_word_embeddings: bool = False,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.head_dim = head_dim
        self.layer_kv_heads = list(layer_kv_heads or [num_attention_heads] * num_hidden_layers)
        self.layer_windows = list(layer_windows or [0] * num_hidden_layers)
        self.rope_fraction = rope_fraction
        self.rope_theta = rope_theta
        none = {"type": "none", "factor": 1.0, "original_max_position_embeddings": max_position_embeddings}
        self.rope_scaling = dict(rope_scaling or none)
        self.rms_norm_eps = rms_norm_eps
        self.n_routed_experts = n_routed_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size
        self.latent_dim = latent_dim
        self.shared_intermediate_size = shared_intermediate_size
        self.router = router
        self.routed_scale = routed_scale
        self.max_position_embeddings = max_position_embeddings
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
