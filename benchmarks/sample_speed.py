"""Generation speed on CPU: `moelab sample`'s KV cache against recomputing the whole sequence.

For each model (the tiny preset, and shape A of vs_transformers.py with a 512-token context) it
generates the same greedy tokens after the same prompt twice, alternating, several rounds:
with the cache (moelab.model.decode.Generator) and by running the full forward over the growing
sequence each step (a fixed-length padded forward, compiled once, the usual no-cache baseline).
It checks that both produce the same tokens, and prints tokens/s of each and their ratio,
compilation excluded. Writes benchmarks/results/sample_speed.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).parent / "results"


def models():
    from moelab.bench import shape_config
    from moelab.config import load_config

    return {
        "tiny": load_config("tiny").model,
        "shape A, context 512": shape_config(seq=512).model,
    }


def no_cache_generator(params, state, m):
    """Greedy by the full forward over a [1, context] buffer: token j's logits at position j."""
    import jax
    import jax.numpy as jnp

    from moelab.model.transformer import forward, logits_of

    @jax.jit
    def logits_at(tokens, j):
        hidden = forward(params, state, tokens, m, "dropless")[0]
        return logits_of(params, jax.lax.dynamic_slice_in_dim(hidden, j, 1, axis=1))[0, 0]

    def generate(prompt, n):
        buf = np.zeros((1, m.seq_len), np.int32)
        buf[0, : len(prompt)] = prompt
        out, pos = [], len(prompt)
        for _ in range(n):
            tok = int(np.argmax(np.asarray(logits_at(jnp.asarray(buf), pos - 1))))
            out.append(tok)
            buf[0, pos] = tok
            pos += 1
        return out

    return generate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import jax

    from moelab.model import init_params, init_state
    from moelab.model.decode import Generator

    res = {"date": str(date.today()), "machine": f"{platform.machine()}, {os.cpu_count()} cores", "jax": jax.__version__,
           "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "models": {}}  # fmt: skip
    for name, m in models().items():
        print(f"{name}: building and compiling both paths ...", file=sys.stderr, flush=True)
        params, state = init_params(m, jax.random.PRNGKey(0)), init_state(m)
        prompt = list(np.random.default_rng(0).integers(0, m.vocab_size, args.prompt_tokens))
        cached = Generator(params, state, m)
        full = no_cache_generator(params, state, m)
        a, b = cached.generate(prompt, 2)[0], full(prompt, 2)  # compile
        times = {"kv cache": [], "full forward": []}
        for r in range(args.rounds):
            t0 = time.perf_counter()
            a = cached.generate(prompt, args.new_tokens)[0]
            times["kv cache"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            b = full(prompt, args.new_tokens)
            times["full forward"].append(time.perf_counter() - t0)
            print(f"  round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        tps = {k: args.new_tokens / float(np.median(v)) for k, v in times.items()}
        same = a == b[: len(a)]
        res["models"][name] = {"params": int(sum(x.size for x in jax.tree.leaves(params))), "context": m.seq_len,
                               "tokens_per_s": tps, "ratio": tps["kv cache"] / tps["full forward"], "same_tokens": same}  # fmt: skip
        print(
            f"{name} (context {m.seq_len}): KV cache {tps['kv cache']:,.0f} tokens/s, full forward "
            f"{tps['full forward']:,.0f} tokens/s: {tps['kv cache'] / tps['full forward']:.1f}x; "
            f"same greedy tokens: {same}",
            flush=True,
        )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sample_speed.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
