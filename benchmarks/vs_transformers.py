"""moelab's train step against Hugging Face transformers' Qwen2-MoE on PyTorch, same shapes, same run.

Both train with AdamW (lr 1e-3, weight decay 0.1, gradient clipping at 1.0) on random tokens, with
the same thread count, alternating: a round of moelab steps, then a round of PyTorch steps,
several times; the median step time of each gives tokens/s and the ratio. Each framework lives in
its own worker process and waits, idle, while the other runs: in one process PyTorch's OpenMP
threads keep spinning after each op and took about a quarter of moelab's speed (measured
2026-12-03: shape B 380 tokens/s beside PyTorch, 515 alone).

The models differ in small ways, stated in the output: Qwen2-MoE gates its shared expert with a
sigmoid of a learned projection and has biases on q, k and v; its loss covers seq - 1 positions
of each sequence (it shifts the labels itself) where moelab's covers seq; moelab's router keeps a
balancing bias (a few scalars). Shapes A and B are the issue's reference shapes; C (narrow, 64 small
experts) and D (wide, 8 large ones) span widths and expert counts (issue 42).

Needs the benchmark extra: pip install -e '.[bench]' (torch, transformers). Writes
benchmarks/results/vs_transformers.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).parent / "results"
SHAPES = {
    "A": dict(d_model=256, layers=4, heads=8, kv_heads=8, experts=16, top_k=4, expert_dim=128, shared=1,
              shared_dim=256, seq=256, batch=8, vocab=4096),
    "B": dict(d_model=512, layers=8, heads=8, kv_heads=8, experts=32, top_k=4, expert_dim=256, shared=1,
              shared_dim=512, seq=512, batch=8, vocab=8192),
    # issue 42's two more: narrow with many small experts, and wide with few large ones
    "C": dict(d_model=128, layers=4, heads=4, kv_heads=4, experts=64, top_k=8, expert_dim=64, shared=1,
              shared_dim=128, seq=256, batch=16, vocab=4096),
    "D": dict(d_model=1024, layers=4, heads=16, kv_heads=16, experts=8, top_k=2, expert_dim=1024, shared=1,
              shared_dim=1024, seq=256, batch=4, vocab=16384),
}  # fmt: skip
DIFFERENCES = (
    "Qwen2-MoE gates its shared expert (sigmoid of a learned projection) and has q/k/v biases; "
    "its loss covers seq - 1 positions per sequence; moelab's router carries a balancing bias"
)


def torch_stepper(shape: dict, threads: int, seed: int = 0):
    import torch
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    cfg = Qwen2MoeConfig(
        vocab_size=shape["vocab"], hidden_size=shape["d_model"], num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        moe_intermediate_size=shape["expert_dim"], shared_expert_intermediate_size=shape["shared_dim"],
        intermediate_size=shape["shared_dim"], num_experts=shape["experts"], num_experts_per_tok=shape["top_k"],
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=shape["seq"],
        output_router_logits=True, router_aux_loss_coef=0.01, tie_word_embeddings=False, use_cache=False,
    )  # fmt: skip
    model = Qwen2MoeForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    rng = np.random.default_rng(seed)
    batches = [torch.from_numpy(rng.integers(0, shape["vocab"], (shape["batch"], shape["seq"]))) for _ in range(4)]
    n_params = sum(p.numel() for p in model.parameters())

    def step(i: int) -> float:
        x = batches[i % 4]
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    step.model = model  # for benchmarks/vs_transformers_parts.py
    return step, n_params


def jax_stepper(shape: dict, seed: int = 0):
    import jax

    from moelab.bench import shape_config
    from moelab.train import optim
    from moelab.train.step import init_train_state, make_train_step

    cfg = shape_config(**shape)
    h = optim.hyper(cfg)
    opt = optim.make_optimizer(cfg, h)
    holder = {"state": init_train_state(cfg, opt)}
    fn = make_train_step(cfg, opt, h)
    rng = np.random.default_rng(seed)
    batches = [rng.integers(0, shape["vocab"], (shape["batch"], shape["seq"] + 1), dtype=np.int32) for _ in range(4)]

    def step(i: int) -> float:
        holder["state"], metrics = fn(holder["state"], batches[i % 4], np.int32(i))
        return float(jax.block_until_ready(metrics["loss"]))

    return step, cfg


def timed(step, start: int, n: int) -> list[float]:
    out = []
    for i in range(start, start + n):
        t0 = time.perf_counter()
        step(i)
        out.append(time.perf_counter() - t0)
    return out


def worker(framework: str, shape: dict, threads: int, conn) -> None:
    """One framework in its own process: build, compile and warm up, then run timed rounds on request."""
    if framework == "moelab":
        t0 = time.perf_counter()
        step, cfg = jax_stepper(shape)
        step(0)  # compiles
        info = {"compile_s": time.perf_counter() - t0, "cfg": cfg}
        step(1)
    else:
        step, n_params = torch_stepper(shape, threads)
        step(0), step(1)
        info = {"params": n_params}
    conn.send(info)
    while (start := conn.recv()) is not None:
        conn.send(timed(step, start, conn.recv()))
    import resource

    conn.send(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # the worker's peak resident memory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default="A,B")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per round and framework")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", type=Path, default=RESULTS / "vs_transformers.json", help="the results file")
    args = ap.parse_args()
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        raise SystemExit("vs_transformers: needs the benchmark extra: pip install -e '.[bench]'") from None
    import jax

    from moelab import accounting
    from moelab._alloc import hugepages_on
    from moelab.cache import matmul_peak

    results = {"date": str(date.today()), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
               "threads": args.threads, "hugepages": hugepages_on(),
               "malloc": os.environ.get("GLIBC_TUNABLES", ""), "jax": jax.__version__, "torch": torch.__version__,
               "transformers": transformers.__version__, "differences": DIFFERENCES, "shapes": {}}  # fmt: skip
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        print(f"shape {name}: starting both workers (moelab compiles, both warm up) ...", file=sys.stderr, flush=True)
        ctx = mp.get_context("spawn")
        pipes, procs = {}, []
        for fw in ("moelab", "transformers"):
            here, there = ctx.Pipe()
            procs.append(ctx.Process(target=worker, args=(fw, shape, args.threads, there), daemon=True))
            procs[-1].start()
            pipes[fw] = here
        info = {fw: pipe.recv() for fw, pipe in pipes.items()}
        cfg, j_compile, t_params = info["moelab"]["cfg"], info["moelab"]["compile_s"], info["transformers"]["params"]
        times = {"moelab": [], "transformers": []}
        for r in range(args.rounds):  # alternate, so both see the same machine; one runs while the other waits
            for fw, pipe in pipes.items():
                pipe.send(2 + r * args.steps)
                pipe.send(args.steps)
                times[fw] += pipe.recv()
            print(f"  round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        for pipe in pipes.values():
            pipe.send(None)
        rss = {fw: pipe.recv() for fw, pipe in pipes.items()}
        for proc in procs:
            proc.join()
        jt, tt = times["moelab"], times["transformers"]
        tokens = shape["batch"] * shape["seq"]
        count = accounting.count(cfg)
        flops = 3 * count.forward_flops_per_token
        peak = matmul_peak()
        j_tps, t_tps = tokens / float(np.median(jt)), tokens / float(np.median(tt))
        res = {
            "shape": shape, "moelab_params": count.total_params, "transformers_params": t_params,
            "moelab_tokens_per_s": j_tps, "transformers_tokens_per_s": t_tps, "ratio": j_tps / t_tps,
            "moelab_step_s": float(np.median(jt)), "transformers_step_s": float(np.median(tt)),
            "moelab_compile_s": j_compile, "model_flops_per_token": flops, "matmul_peak_flops_per_s": peak,
            "moelab_mfu": j_tps * flops / peak, "transformers_mfu": t_tps * flops / peak,
            "moelab_peak_rss_gb": rss["moelab"] / 1e9, "transformers_peak_rss_gb": rss["transformers"] / 1e9,
        }  # fmt: skip
        results["shapes"][name] = res
        print(
            f"shape {name}: moelab {j_tps:,.0f} tokens/s (MFU {res['moelab_mfu']:.1%}), transformers "
            f"{t_tps:,.0f} tokens/s (MFU {res['transformers_mfu']:.1%}): {res['ratio']:.2f}x; "
            f"params {count.total_params:,} vs {t_params:,}; moelab compile {j_compile:.1f} s",
            flush=True,
        )
    print(f"differences: {DIFFERENCES}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
