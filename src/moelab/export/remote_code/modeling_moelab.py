"""moelab's MoE transformer in PyTorch, for Hugging Face transformers (written by `moelab export hf`).

Copied into an exported model's directory and loaded with
``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)``; it needs only torch and
transformers. The same arithmetic as moelab's JAX model (moelab/model/), in fp32 where moelab
uses fp32 (norms, router, softmax):

- pre-norm layers: x += attention(rms_norm(x)); x += moe(rms_norm(x)); a final norm; an untied head;
- attention: q, k, v projections without bias; RMS qk-norm without weight; RoPE on the first
  ``rope_fraction`` of each head's dims (half-split pairs), its frequencies scaled as
  ``rope_scaling`` says (``rope_frequencies``: none, pi, ntk or yarn); grouped kv heads, their count
  per layer; causal, and a sliding window on local layers (``layer_windows``, 0 = global);
- MoE: router logits in fp32; softmax or sigmoid scores; the top k of logits + the router's bias
  (the bias only picks experts); gates = the chosen scores renormalised to sum to ``routed_scale``;
  each token's k experts are SwiGLUs (dropless: every token reaches its experts), in a latent width
  when ``latent_dim`` > 0 (down-projected, RMS-normed, and the sum up-projected); plus the shared
  experts, one SwiGLU ``shared_intermediate_size`` wide, on every token.

Padded batches: ``attention_mask`` (1 = a real token) hides padded keys from every query, and
positions count real tokens only (``cumsum(mask) - 1``), so left or right padding leaves a real
token's logits as they are unpadded; routing is per token and dropless, so pad tokens cannot change
other tokens' experts. ``generate()`` keeps a KV cache (transformers' ``DynamicCache``, the keys
after RoPE): each step computes only the new tokens.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_moelab import MoelabConfig

YARN_ALPHA, YARN_BETA = 1.0, 32.0  # YaRN's ramp, in rotations over the original context


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def rope_frequencies(half: int, theta: float, scaling: tuple = ("none", 1.0, 0)) -> tuple[torch.Tensor, float]:
    """The ``half`` rotary frequencies (float64) and the factor on cos and sin, for ``scaling`` =
    (kind, factor s, original context L0); moelab's ``rope_frequencies``, in torch. f_i = theta^(-i/half);
    none (or s <= 1): f_i; pi: f_i / s; ntk: theta raised to theta * s^(rot / (rot - 2)), rot = 2 half;
    yarn: r_i = L0 f_i / 2pi, g_i = clip((r_i - 1) / 31, 0, 1), f_i ((1 - g_i) / s + g_i), and cos and
    sin times 0.1 ln s + 1."""
    kind, s, base = scaling
    i = torch.arange(half, dtype=torch.float64)
    f = torch.pow(torch.tensor(float(theta), dtype=torch.float64), -i / half)
    if kind == "none" or s <= 1.0:
        return f, 1.0
    if kind == "pi":
        return f / s, 1.0
    if kind == "ntk":
        rot = 2 * half
        return torch.pow(torch.tensor(float(theta) * s ** (rot / (rot - 2)), dtype=torch.float64), -i / half), 1.0
    if kind == "yarn":
        g = ((base * f / (2 * math.pi) - YARN_ALPHA) / (YARN_BETA - YARN_ALPHA)).clamp(0.0, 1.0)
        return f * ((1.0 - g) / s + g), 0.1 * math.log(s) + 1.0
    raise ValueError(f"rope_scaling type {kind!r}: use none, pi, ntk or yarn")


def rope_tables(config: MoelabConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for ``positions`` [b, s]: [b, s, 1, half] each, in fp32 as moelab computes them."""
    half = int(config.head_dim * config.rope_fraction) // 2
    sc = config.rope_scaling or {}
    scaling = (sc.get("type", "none"), float(sc.get("factor", 1.0)), int(sc.get("original_max_position_embeddings", 0)))
    f, mscale = rope_frequencies(half, config.rope_theta, scaling)
    angles = positions.float()[..., None] * f.to(torch.float32).to(positions.device)
    return (torch.cos(angles) * mscale)[:, :, None, :], (torch.sin(angles) * mscale)[:, :, None, :]


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [b, s, heads, hd]; rotates the first 2 * half dims (cos, sin: [b, s, 1, half]), pairing i with i + half."""
    half = cos.shape[-1]
    x32 = x.float()
    x1, x2, rest = x32[..., :half], x32[..., half : 2 * half], x32[..., 2 * half :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1).to(x.dtype)


class MoelabAttention(nn.Module):
    def __init__(self, config: MoelabConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.heads, self.hd = config.num_attention_heads, config.head_dim
        self.kv = config.layer_kv_heads[layer]
        self.eps = config.rms_norm_eps
        d = config.hidden_size
        self.q_proj = nn.Linear(d, self.heads * self.hd, bias=False)
        self.k_proj = nn.Linear(d, self.kv * self.hd, bias=False)
        self.v_proj = nn.Linear(d, self.kv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.heads * self.hd, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seen: torch.Tensor, cache=None):
        """x: [b, s, d]; ``seen``: [b, s, t] which of the t keys (the cache's and these) each query may see."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.hd)
        k = self.k_proj(x).view(b, s, self.kv, self.hd)
        v = self.v_proj(x).view(b, s, self.kv, self.hd)
        q = rope(rms_norm(q, None, self.eps), cos, sin)
        k = rope(rms_norm(k, None, self.eps), cos, sin).transpose(1, 2)  # [b, kv, s, hd]
        v = v.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, self.layer)  # [b, kv, t, hd]
        g = self.heads // self.kv
        q = q.view(b, s, self.kv, g, self.hd).permute(0, 2, 3, 1, 4)  # [b, kv, g, s, hd]
        scores = torch.matmul(q.float(), k.float()[:, :, None].transpose(-1, -2)) * self.hd**-0.5
        # the lowest finite value, not -inf: a padded query that sees no key gets finite (unused) outputs
        scores = scores.masked_fill(~seen[:, None, None], torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        out = torch.matmul(probs, v[:, :, None])  # [b, kv, g, s, hd]
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

    def forward(self, x: torch.Tensor, cos, sin, seen, cache=None) -> torch.Tensor:
        x = x + self.self_attn(rms_norm(x, self.attn_norm, self.eps), cos, sin, seen, cache)
        return x + self.mlp(rms_norm(x, self.mlp_norm, self.eps))


# the output's field for the KV cache: ``cache`` from transformers 5.25, ``past_key_values`` before
CACHE_FIELD = "cache" if "cache" in getattr(CausalLMOutputWithPast, "__dataclass_fields__", {}) else "past_key_values"


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

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
    ) -> torch.Tensor:
        """The final hidden states of ``input_ids`` [b, s], after the ``cache``'s past tokens (if any).

        ``attention_mask``: [b, past + s], 1 for a real token (None: all real). Positions (unless given)
        count the real tokens before each one; a query sees the real keys at or before its slot, and
        on a local layer only the last ``window`` slots (a row's real tokens are contiguous, so slots
        and positions differ by a constant)."""
        b, s = input_ids.shape
        past = cache.get_seq_length() if cache is not None else 0
        t = past + s
        dev = input_ids.device
        if attention_mask is not None and tuple(attention_mask.shape) != (b, t):
            raise ValueError(f"attention_mask: shape {tuple(attention_mask.shape)}; expected a 2-D mask [{b}, {t}] "
                             "(1 = a token, 0 = padding) over the past and the new tokens")  # fmt: skip
        real = attention_mask.bool() if attention_mask is not None else torch.ones(b, t, dtype=torch.bool, device=dev)
        if position_ids is None:
            position_ids = (real.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
        position_ids = position_ids.expand(b, s)
        if int(position_ids.max()) >= self.config.max_position_embeddings:
            raise ValueError(
                f"{int(position_ids.max()) + 1} tokens: the model's context is {self.config.max_position_embeddings}"
            )
        cos, sin = rope_tables(self.config, position_ids)
        i = torch.arange(past, t, device=dev)[:, None]
        j = torch.arange(t, device=dev)[None, :]
        causal = (j <= i)[None] & real[:, None, :]  # [b, s, t]
        masks: dict[int, torch.Tensor] = {}
        x = self.embed_tokens(input_ids)
        for layer, window in zip(self.layers, self.config.layer_windows, strict=True):
            if window not in masks:
                masks[window] = causal & (i - j < window)[None] if window else causal
            x = layer(x, cos, sin, masks[window], cache)
        return rms_norm(x, self.norm, self.config.rms_norm_eps)


class MoelabForCausalLM(MoelabPreTrainedModel, GenerationMixin):
    def __init__(self, config: MoelabConfig):
        super().__init__(config)
        self.model = MoelabModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        labels: torch.LongTensor | None = None,
        logits_to_keep: int = 0,
        cache: Cache | None = None,
        **kwargs,
    ):
        """Logits [b, s, vocab] (the last ``logits_to_keep`` positions if > 0). With ``use_cache`` (or a
        cache given) the keys and values are kept in a ``DynamicCache``, returned in the output;
        ``generate()`` does this for every step. transformers up to 5.24 passes and reads the cache as
        ``past_key_values``, 5.25 on as ``cache``: both are taken, and the output names it as the
        installed version's ``CausalLMOutputWithPast`` declares."""
        if past_key_values is None:
            past_key_values = cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        cache = past_key_values if use_cache is not False else None
        hidden = self.model(input_ids, attention_mask, position_ids, cache)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden).float()
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache})
