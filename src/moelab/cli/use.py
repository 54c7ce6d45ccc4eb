"""`moelab sample` and `moelab export`: use what a run trained."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from moelab.errors import UsageError


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def cmd_sample(args: argparse.Namespace) -> int:
    from tokenizers import Tokenizer

    from moelab.config import final_model
    from moelab.export import checkpoint_step, load_trained, tokenizer_of
    from moelab.model.decode import Generator, check_sampling
    from moelab.runs import load_run_config

    check_sampling(args.temperature, args.top_k, args.top_p, args.max_new_tokens)
    cfg = load_run_config(args.run_dir)  # bad input is refused in one line before anything loads
    step = checkpoint_step(args.run_dir, args.checkpoint)
    tok = Tokenizer.from_file(str(tokenizer_of(args.run_dir, cfg)))
    prompt = tok.encode(args.prompt).ids
    if len(prompt) > cfg.model.seq_len:
        raise UsageError(
            f"--prompt: {len(prompt)} tokens, the model's context is {cfg.model.seq_len}: shorten the prompt"
        )
    stop = tok.token_to_id("<|endoftext|>")
    _say(f"loading {args.run_dir} at step {step} ...")
    t = load_trained(args.run_dir, step)
    gen = Generator(t.params, t.model_state, final_model(t.cfg))  # the last phase's context and RoPE
    stream = sys.stdout.isatty() and not args.json
    shown = [""]
    new: list[int] = []

    def on_token(tok_id: int) -> None:
        new.append(tok_id)
        if stream:  # print what the tokens so far add to the text (a token may end mid-character)
            text = tok.decode(new)
            if not text.endswith("\ufffd"):
                sys.stdout.write(text[len(shown[0]) :])
                sys.stdout.flush()
                shown[0] = text

    _say(f"compiling and generating up to {args.max_new_tokens} tokens after a {len(prompt)}-token prompt ...")
    t0 = time.perf_counter()
    out, _ = gen.generate(
        prompt, args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed, stop, on_token
    )
    seconds = time.perf_counter() - t0
    text = tok.decode(out)
    if args.json:
        print(
            json.dumps({"step": step, "prompt": args.prompt, "text": text, "tokens": out, "seconds": seconds}, indent=1)
        )
    elif stream:
        sys.stdout.write(text[len(shown[0]) :] + "\n")
    else:
        print(text)
    why = (
        "the end-of-text token"
        if out and out[-1] == stop
        else ("the context's end" if len(out) < args.max_new_tokens else "")
    )
    _say(f"{len(out)} tokens in {seconds:.1f} s (compiling included){'; stopped at ' + why if why else ''}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from moelab.export import checkpoint_step
    from moelab.export.hf import check_out, export_hf, export_safetensors
    from moelab.runs import load_run_config

    load_run_config(args.run_dir)
    step = checkpoint_step(args.run_dir, args.checkpoint)
    check_out(Path(args.out), is_dir=args.format == "hf")
    _say(f"exporting {args.run_dir} at step {step} to {args.out} ({args.format}) ...")
    res = (export_hf if args.format == "hf" else export_safetensors)(args.run_dir, args.out, step)
    print(f"wrote {res['out']}: {res['tensors']} tensors, {res['params']:,} values, step {res['step']}")
    if args.format == "hf":
        print(f"  load it: AutoModelForCausalLM.from_pretrained({res['out']!r}, trust_remote_code=True)")
    return 0


def register(sub) -> None:
    p = sub.add_parser("sample", help="generate text from a run's checkpoint (KV cache, dropless MoE)")
    p.add_argument("run_dir", help="a run directory (train --out)")
    p.add_argument("--checkpoint", type=int, metavar="STEP", help="default: the newest")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=1.0, metavar="T", help="0: greedy (default 1)")
    p.add_argument(
        "--top-p", type=float, default=1.0, metavar="P", help="sample from the top P of the probability mass"
    )
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="sample from the K likeliest tokens (0: all)")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed (default 0)")
    p.add_argument("--json", action="store_true", help="print the result as JSON (text, token ids, seconds)")
    p.set_defaults(func=cmd_sample)

    p = sub.add_parser("export", help="a run's checkpoint for other tools: hf (transformers) or safetensors")
    p.add_argument(
        "format", choices=["hf", "safetensors"], help="hf: a transformers model folder; safetensors: one file"
    )
    p.add_argument("run_dir", help="a run directory (train --out)")
    p.add_argument("--out", required=True, help="hf: a new directory; safetensors: a new file")
    p.add_argument("--checkpoint", type=int, metavar="STEP", help="default: the newest")
    p.set_defaults(func=cmd_export)
