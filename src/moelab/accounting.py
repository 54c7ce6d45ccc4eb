"""Parameters and FLOPs of a config, by Marin's definitions (shared/reference/marin_hero.json).

Active parameters: attention, router, top-k routed experts, latent projections and shared
experts of every layer; no embeddings, LM head or norms. Forward FLOPs per token: twice the
multiply-adds of every matmul a token passes through, plus attention's span*heads*(4*head_dim+3)
per layer, span = window on local layers and the sequence on global ones; training = 3 x forward.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from moelab.config import Config, ModelConfig, phase_config, phase_seq_lens
from moelab.schedule import phase_boundaries


@dataclass(frozen=True)
class Accounting:
    total_params: int  # every parameter but norms: embeddings, head, all experts
    total_params_nonembedding: int  # the same without token embedding and LM head
    embedding_params: int  # token embedding + LM head (untied)
    norm_params: int  # RMSNorm weights, outside Marin's counts
    active_params: int  # Marin's definition
    active_params_with_embeddings: int
    forward_flops_per_token: float  # with the LM head
    forward_flops_per_token_without_lm_head: float
    lm_head_flops_per_token: float

    def train(self, tokens: float) -> dict:
        """Everything `moelab flops --json` prints for a run of ``tokens`` tokens."""
        out = asdict(self)
        out.update(
            tokens=float(tokens),
            train_flops=3.0 * self.forward_flops_per_token * tokens,
            train_flops_without_lm_head=3.0 * self.forward_flops_per_token_without_lm_head * tokens,
            six_n_d=6.0 * self.active_params * tokens,
        )
        return out


def _layer(m: ModelConfig, layer: int) -> tuple[int, int, int, float]:
    """(params with all experts, active params, matmul params a token passes, attention flops)."""
    d, hd, h = m.d_model, m.head_size, m.n_heads
    # Marin allocates k/v with the local kv-head count in every layer (the layers stack), but a
    # global layer with fewer kv heads only multiplies by that many.
    attn_params = 2 * d * h * hd + 2 * d * m.kv_heads_alloc * hd
    attn_used = 2 * d * h * hd + 2 * d * m.layer_kv_heads(layer) * hd
    router = d * m.n_routed
    din = m.expert_in_dim
    latent = 2 * d * m.latent_dim if m.latent_dim else 0
    expert = 3 * din * m.expert_dim
    shared = m.n_shared * 3 * d * m.shared_dim
    total = attn_params + router + latent + shared + m.n_routed * expert
    active = attn_params + router + latent + shared + m.top_k * expert
    used = attn_used + router + latent + shared + m.top_k * expert
    attn_flops = m.layer_span(layer) * h * (4 * hd + 3)
    return total, active, used, attn_flops


def count(cfg: Config | ModelConfig) -> Accounting:
    m = cfg.model if isinstance(cfg, Config) else cfg
    total = active = 0
    fwd = 0.0
    for layer in range(m.n_layers):
        t, a, used, attn_flops = _layer(m, layer)
        total += t
        active += a
        fwd += 2.0 * used + attn_flops
    emb = 2 * m.vocab_size * m.d_model
    norms = m.n_layers * (2 * m.d_model + m.latent_dim) + m.d_model
    head_flops = 2.0 * m.d_model * m.vocab_size
    return Accounting(
        total_params=total + emb,
        total_params_nonembedding=total,
        embedding_params=emb,
        norm_params=norms,
        active_params=active,
        active_params_with_embeddings=active + emb,
        forward_flops_per_token=fwd + head_flops,
        forward_flops_per_token_without_lm_head=fwd,
        lm_head_flops_per_token=head_flops,
    )


def run_tokens(cfg: Config) -> int:
    """Tokens a config's run trains on: steps x batch sequences x sequence length."""
    return cfg.train.steps * cfg.train.batch_size * cfg.model.seq_len


def run_train(cfg: Config) -> dict:
    """``count(cfg).train(run_tokens(cfg))``, with a long-context phase (data.phase_seq_lens) counted
    phase by phase: each phase's tokens at its own sequence length's FLOPs per token (attention's span
    grows with it); ``phases`` lists them."""

    lens = phase_seq_lens(cfg)
    out = count(cfg).train(run_tokens(cfg))
    if len(set(lens)) == 1:
        return out
    starts = list(phase_boundaries(cfg.data.phase_starts, cfg.train)) + [cfg.train.steps]
    per_step = cfg.train.batch_size * cfg.model.seq_len
    phases = []
    for p, length in enumerate(lens):
        a = count(phase_config(cfg, p))
        tokens = max(0, min(starts[p + 1], cfg.train.steps) - starts[p]) * per_step
        phases.append({"seq_len": length, "steps": tokens // per_step, "tokens": tokens,
                       "train_flops": 3.0 * a.forward_flops_per_token * tokens,
                       "train_flops_without_lm_head": 3.0 * a.forward_flops_per_token_without_lm_head * tokens})  # fmt: skip
    out["train_flops"] = sum(x["train_flops"] for x in phases)
    out["train_flops_without_lm_head"] = sum(x["train_flops_without_lm_head"] for x in phases)
    out["phases"] = phases
    return out


def human(x: float) -> str:
    """3 significant figures with an SI suffix: 535.3B, 2.70e24 stays scientific past T."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= div:
            if div == 1e12 and abs(x) >= 1e15:
                return f"{x:.3g}"
            return f"{x / div:.4g}{suffix}"
    return f"{x:.4g}"
