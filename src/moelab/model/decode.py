"""Generation with a KV cache: prefill the prompt once, then one token a step.

Every layer keeps its keys and values in a ring of slots: a sliding-window layer keeps only its
window (``min(window, context)`` slots), a global layer the whole context. Each slot remembers the
position it holds, so the mask is computed from positions (causal, and the window) and a slot
that has not been written yet (position -1) is never seen. The MoE runs dropless, each token on
its own top-k experts as the full forward's dropless dispatch does (a one-token step gathers
its k experts' weights: ``moe.dropless_gathered``); so the cached logits equal the
full forward's at every position (tests/test_decode.py), past the window included.

Sampling is on the host, in float64, from an explicit seed: temperature 0 is greedy; otherwise
the logits over the temperature, cut to the top k and then to the top p of the probability mass.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from moelab.config import ModelConfig, rope_scaling_of
from moelab.errors import UsageError
from moelab.model.layers import group_kv, rms_norm, rope
from moelab.model.moe import moe_block
from moelab.model.transformer import cast_params, logits_of


def cache_slots(m: ModelConfig, context: int) -> list[int]:
    """Slots per layer: the window on sliding-window layers, the context on global ones."""
    return [
        context if m.is_global(i) or not m.sliding_window else min(m.sliding_window, context) for i in range(m.n_layers)
    ]


def init_cache(m: ModelConfig, batch: int, context: int, dtype=jnp.float32) -> list[dict]:
    """An empty cache: per layer k and v [batch, slots, kv heads, head_dim] and each slot's position (-1: empty)."""
    out = []
    for i, n in enumerate(cache_slots(m, context)):
        shape = (batch, n, m.layer_kv_heads(i), m.head_size)
        out.append({"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype), "pos": jnp.full((n,), -1, jnp.int32)})
    return out


def _attend(p: dict, x: jax.Array, positions: jax.Array, cache: dict, m: ModelConfig, i: int):
    """The new tokens' attention over the cached keys and their own. x: [b, n, d], positions: [n]."""
    b, n, _ = x.shape
    hd, heads, kv = m.head_size, m.n_heads, m.layer_kv_heads(i)
    window = 0 if m.is_global(i) else m.sliding_window
    q = (x @ p["wq"]).reshape(b, n, heads, hd)
    k = (x @ group_kv(p["wk"], m.kv_heads_alloc, kv)).reshape(b, n, kv, hd)
    v = (x @ group_kv(p["wv"], m.kv_heads_alloc, kv)).reshape(b, n, kv, hd)
    q = rope(rms_norm(q, eps=m.norm_eps), positions, m.rope_fraction, m.rope_theta, rope_scaling_of(m))
    k = rope(rms_norm(k, eps=m.norm_eps), positions, m.rope_fraction, m.rope_theta, rope_scaling_of(m))
    keys = jnp.concatenate([cache["k"], k.astype(cache["k"].dtype)], axis=1)
    values = jnp.concatenate([cache["v"], v.astype(cache["v"].dtype)], axis=1)
    key_pos = jnp.concatenate([cache["pos"], positions])
    seen = (key_pos[None, :] >= 0) & (key_pos[None, :] <= positions[:, None])
    if window:
        seen = seen & (positions[:, None] - key_pos[None, :] < window)
    qg = (q * hd**-0.5).reshape(b, n, kv, heads // kv, hd)
    scores = jnp.einsum("bnkgh,bpkh->bkgnp", qg, keys.astype(q.dtype), preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(jnp.where(seen, scores, -1e30), axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgnp,bpkh->bnkgh", probs, values.astype(v.dtype)).reshape(b, n, heads * hd)
    slots = cache["k"].shape[1]
    keep = min(n, slots)  # only the last `slots` new tokens can stay; each goes to slot position % slots
    where = positions[-keep:] % slots
    new = {
        "k": cache["k"].at[:, where].set(k[:, -keep:].astype(cache["k"].dtype)),
        "v": cache["v"].at[:, where].set(v[:, -keep:].astype(cache["v"].dtype)),
        "pos": cache["pos"].at[where].set(positions[-keep:]),
    }
    return out @ p["wo"], new


def forward_cached(params: dict, state: dict, tokens: jax.Array, start: jax.Array, cache: list[dict], m: ModelConfig):
    """tokens [b, n] at positions start..start+n-1, after what the cache holds -> (logits [b, n, vocab]
    in fp32, the updated cache). n is the prompt's length when prefilling, 1 when decoding."""
    dtype = jnp.dtype(m.dtype)
    if dtype != jnp.float32:
        params = cast_params(params, dtype)
    positions = start + jnp.arange(tokens.shape[1], dtype=jnp.int32)
    x = params["embed"][tokens]
    new_cache = []
    for i in range(m.n_layers):
        p = {k: v[i] for k, v in params["layers"].items()}
        a, c = _attend(p, rms_norm(x, p["attn_norm"], m.norm_eps), positions, cache[i], m, i)
        new_cache.append(c)
        x = x + a
        x = x + moe_block(p, rms_norm(x, p["mlp_norm"], m.norm_eps), state["router_bias"][i], m, "dropless")[0]
    x = rms_norm(x, params["final_norm"], m.norm_eps)
    return logits_of(params, x), new_cache


def pick(logits: np.ndarray, rng: np.random.Generator, temperature: float, top_k: int = 0, top_p: float = 1.0) -> int:
    """The next token from one position's logits: greedy at temperature 0, else sampled from the
    tempered distribution cut to the ``top_k`` likeliest tokens (0: all) and then to the smallest
    set of them whose probability reaches ``top_p``."""
    logits = np.asarray(logits, np.float64)
    if temperature == 0:
        return int(np.argmax(logits))
    order = np.argsort(-logits, kind="stable")
    if top_k:
        order = order[:top_k]
    z = logits[order] / temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    if top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), top_p)) + 1  # the token that reaches top_p is kept
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    return int(order[rng.choice(len(order), p=probs)])


def check_sampling(temperature: float, top_k: int, top_p: float, max_new: int, seed: int = 0) -> None:
    """One line naming the flag, for values that cannot sample."""
    if not (temperature >= 0 and math.isfinite(temperature)):  # (nan fails every comparison)
        raise UsageError(f"--temperature {temperature}: must be 0 (greedy) or a finite number above it")
    if top_k < 0:
        raise UsageError(f"--top-k {top_k}: must be 0 (all tokens) or more")
    if not 0 < top_p <= 1:
        raise UsageError(f"--top-p {top_p}: must be in (0, 1]")
    if max_new < 1:
        raise UsageError(f"--max-new-tokens {max_new}: must be at least 1")
    if seed < 0:
        raise UsageError(f"--seed {seed}: must be 0 or more")


PREFILL_CHUNKS = (256, 64, 16, 4, 1)


def _chunks(n: int) -> list[int]:
    """``n`` as a sum of PREFILL_CHUNKS, largest first."""
    out = []
    for c in PREFILL_CHUNKS:
        out += [c] * (n // c)
        n %= c
    return out


class Generator:
    """A model ready to generate: the prefill and the one-token step compiled once per shape."""

    def __init__(self, params: dict, state: dict, m: ModelConfig, context: int | None = None):
        self.params, self.state, self.m = params, state, m
        self.context = context or m.seq_len
        self._step = jax.jit(lambda p, s, t, start, c: forward_cached(p, s, t, start, c, m))

    def generate(
        self,
        prompt: list[int],
        max_new: int,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop: int | None = None,
        on_token: Callable[[int], None] | None = None,
        keep_logits: bool = False,
        until: Callable[[list[int]], bool] | None = None,
        chunked: bool = False,
    ) -> tuple[list[int], list[np.ndarray]]:
        """New tokens after ``prompt`` (at most ``max_new``, fewer at ``stop``, where ``until(new tokens)``
        is true, or at the context's end), and with ``keep_logits`` the logits each was picked from.
        ``chunked`` prefills the prompt in pieces of PREFILL_CHUNKS tokens, so that prompts of many
        lengths compile a handful of shapes, not one each (an evaluation over many prompts)."""
        check_sampling(temperature, top_k, top_p, max_new, seed)
        if not prompt:
            raise UsageError("--prompt: empty; give at least one token's worth of text")
        if len(prompt) > self.context:
            raise UsageError(
                f"--prompt: {len(prompt)} tokens, the model's context is {self.context}: shorten the prompt"
            )
        rng = np.random.default_rng(seed)
        cache = init_cache(self.m, 1, self.context, jnp.dtype(self.m.dtype))
        pieces = _chunks(len(prompt)) if chunked else [len(prompt)]
        at = 0
        for n in pieces:
            piece = jnp.asarray([prompt[at : at + n]], jnp.int32)
            logits, cache = self._step(self.params, self.state, piece, jnp.int32(at), cache)
            at += n
        out, kept = [], []
        pos = len(prompt)
        while True:
            last = np.asarray(logits[0, -1])
            if keep_logits:
                kept.append(last)
            tok = pick(last, rng, temperature, top_k, top_p)
            out.append(tok)
            if on_token is not None:
                on_token(tok)
            if (
                tok == stop or len(out) == max_new or pos >= self.context or (until is not None and until(out))
            ):  # the next input would be past the context
                return out, kept
            logits, cache = self._step(self.params, self.state, jnp.asarray([[tok]], jnp.int32), jnp.int32(pos), cache)
            pos += 1
