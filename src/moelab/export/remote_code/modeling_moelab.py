"""moelab's MoE transformer in PyTorch, for Hugging Face transformers (written by `moelab export hf`).

Copied into an exported model's directory and loaded with
``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)``; it needs only torch and
transformers. The same arithmetic as moelab's JAX model (moelab/model/), in fp32 where moelab
uses fp32 (norms, router, softmax):

- pre-norm layers: x += attention(rms_norm(x)); x += moe(rms_norm(x)); a final norm; an untied head;
- attention: q, k, v projections without bias; RMS qk-norm without weight; RoPE on the first
  ``rope_fraction`` of each head's dims (half-split pairs); grouped kv heads, their count per
  layer; causal, and a sliding window on local layers (``layer_windows``, 0 = global);
- MoE: router logits in fp32; softmax or sigmoid scores; the top k of logits + the router's bias
  (the bias only picks experts); gates = the chosen scores renormalised to sum to ``routed_scale``;
  each token's k experts are SwiGLUs (dropless: every token reaches its experts), in a latent width
  when ``latent_dim`` > 0 (down-projected, RMS-normed, and the sum up-projected); plus the shared
  experts, one SwiGLU ``shared_intermediate_size`` wide, on every token.

Generation recomputes the whole sequence each step (no KV cache here): ``generate()`` works, at
the cost of speed; ``moelab sample`` is the cached path. Padded batches are refused (positions
would shift): one prompt, or prompts of the same length.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_moelab import MoelabConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, fraction: float, theta: float) -> torch.Tensor:
    """x: [b, s, heads, hd]; rotates the first ``fraction`` of hd, pairing i with i + rot/2."""
    hd = x.shape[-1]
    rot = int(hd * fraction)
    half = rot // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
    angles = positions.float()[:, None] * freqs[None, :]
    cos, sin = torch.cos(angles)[None, :, None, :], torch.sin(angles)[None, :, None, :]
    x32 = x.float()
    x1, x2, rest = x32[..., :half], x32[..., half:rot], x32[..., rot:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1).to(x.dtype)


class MoelabAttention(nn.Module):
    def __init__(self, config: MoelabConfig, layer: int):
        super().__init__()
        self.heads, self.hd = config.num_attention_heads, config.head_dim
        self.kv = config.layer_kv_heads[layer]
        self.window = config.layer_windows[layer]
        self.eps, self.fraction, self.theta = config.rms_norm_eps, config.rope_fraction, config.rope_theta
        d = config.hidden_size
        self.q_proj = nn.Linear(d, self.heads * self.hd, bias=False)
        self.k_proj = nn.Linear(d, self.kv * self.hd, bias=False)
        self.v_proj = nn.Linear(d, self.kv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.heads * self.hd, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        pos = torch.arange(s, device=x.device)
        q = self.q_proj(x).view(b, s, self.heads, self.hd)
        k = self.k_proj(x).view(b, s, self.kv, self.hd)
        v = self.v_proj(x).view(b, s, self.kv, self.hd)
        q = rope(rms_norm(q, None, self.eps), pos, self.fraction, self.theta)
        k = rope(rms_norm(k, None, self.eps), pos, self.fraction, self.theta)
        g = self.heads // self.kv
        q = q.view(b, s, self.kv, g, self.hd).permute(0, 2, 3, 1, 4)  # [b, kv, g, s, hd]
        k, v = k.permute(0, 2, 1, 3)[:, :, None], v.permute(0, 2, 1, 3)[:, :, None]  # [b, kv, 1, s, hd]
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * self.hd**-0.5
        i, j = pos[:, None], pos[None, :]
        seen = j <= i
        if self.window:
            seen = seen & (i - j < self.window)
        probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1).to(v.dtype)
        out = torch.matmul(probs, v)  # [b, kv, g, s, hd]
        return self.o_proj(out.permute(0, 3, 1, 2, 4).reshape(b, s, self.heads * self.hd))


class MoelabExperts(nn.Module):
    """The routed experts' weights, [experts, in, out] as in moelab (x @ w)."""

    def __init__(self, config: MoelabConfig):
        super().__init__()
        e, f = config.n_routed_experts, config.moe_intermediate_size
        din = config.latent_dim or config.hidden_size
        self.w_gate = nn.Parameter(torch.empty(e, din, f))
        self.w_up = nn.Parameter(torch.empty(e, din, f))
        self.w_down = nn.Parameter(torch.empty(e, f, din))

    def forward(self, h: torch.Tensor, idx: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """h: [t, din]; idx, gates: [t, k] -> the gate-weighted sum of each token's experts, [t, din]."""
        out = torch.zeros_like(h)
        for e in torch.unique(idx).tolist():  # dropless: every token that chose e, exactly
            tok, slot = torch.nonzero(idx == e, as_tuple=True)
            x = h[tok]
            y = (nn.functional.silu(x @ self.w_gate[e]) * (x @ self.w_up[e])) @ self.w_down[e]
            out.index_add_(0, tok, y * gates[tok, slot, None].to(y.dtype))
        return out


class MoelabMoE(nn.Module):
    def __init__(self, config: MoelabConfig):
        super().__init__()
        d, self.k = config.hidden_size, config.num_experts_per_tok
        self.router_kind, self.scale, self.eps = config.router, config.routed_scale, config.rms_norm_eps
        self.router = nn.Linear(d, config.n_routed_experts, bias=False)
        self.register_buffer("router_bias", torch.zeros(config.n_routed_experts))  # picks experts, not a gate
        self.experts = MoelabExperts(config)
        self.latent = config.latent_dim
        if self.latent:
            self.latent_down = nn.Linear(d, self.latent, bias=False)
            self.latent_norm = nn.Parameter(torch.ones(self.latent))
            self.latent_up = nn.Linear(self.latent, d, bias=False)
        self.shared = config.shared_intermediate_size
        if self.shared:
            self.shared_gate = nn.Linear(d, self.shared, bias=False)
            self.shared_up = nn.Linear(d, self.shared, bias=False)
            self.shared_down = nn.Linear(self.shared, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        xt = x.reshape(b * s, d)
        logits = xt.float() @ self.router.weight.float().T
        if self.router_kind == "softmax":
            scores, target = torch.softmax(logits, dim=-1), 1.0
        else:
            scores, target = torch.sigmoid(logits), self.scale
        idx = torch.topk(logits + self.router_bias.float(), self.k, dim=-1).indices
        chosen = torch.gather(scores, 1, idx)
        gates = chosen * (target / (chosen.sum(-1, keepdim=True) + 1e-20))
        h = rms_norm(self.latent_down(xt), self.latent_norm, self.eps) if self.latent else xt
        y = self.experts(h, idx, gates)
        if self.latent:
            y = self.latent_up(y)
        if self.shared:
            y = y + self.shared_down(nn.functional.silu(self.shared_gate(xt)) * self.shared_up(xt))
        return y.reshape(b, s, d)


class MoelabLayer(nn.Module):
    def __init__(self, config: MoelabConfig, layer: int):
        super().__init__()
        self.eps = config.rms_norm_eps
        self.attn_norm = nn.Parameter(torch.ones(config.hidden_size))
        self.self_attn = MoelabAttention(config, layer)
        self.mlp_norm = nn.Parameter(torch.ones(config.hidden_size))
        self.mlp = MoelabMoE(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(rms_norm(x, self.attn_norm, self.eps))
        return x + self.mlp(rms_norm(x, self.mlp_norm, self.eps))


class MoelabPreTrainedModel(PreTrainedModel):
    config_class = MoelabConfig
    base_model_prefix = "model"
    _no_split_modules = ["MoelabLayer"]

    def _init_weights(self, module):  # weights come from the checkpoint; nothing to initialise
        pass


class MoelabModel(MoelabPreTrainedModel):
    def __init__(self, config: MoelabConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MoelabLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = nn.Parameter(torch.ones(config.hidden_size))
        self.post_init()

    def forward(self, input_ids: torch.LongTensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return rms_norm(x, self.norm, self.config.rms_norm_eps)


class MoelabForCausalLM(MoelabPreTrainedModel, GenerationMixin):
    def __init__(self, config: MoelabConfig):
        super().__init__(config)
        self.model = MoelabModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):  # no cache: the whole
        return {"input_ids": input_ids, "attention_mask": attention_mask}  # sequence each step

    def forward(
        self,
        input_ids: torch.LongTensor,
        labels: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs,
    ):
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("padded batches are not supported: give one prompt, or prompts of the same length")
        if input_ids.shape[1] > self.config.max_position_embeddings:
            raise ValueError(
                f"{input_ids.shape[1]} tokens: the model's context is {self.config.max_position_embeddings}"
            )
        logits = self.lm_head(self.model(input_ids)).float()
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return CausalLMOutputWithPast(loss=loss, logits=logits)
