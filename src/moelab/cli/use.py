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


def _prompt_text(args: argparse.Namespace, cfg) -> tuple[str, list[str]]:
    """The text to continue and the strings that end the reply: --prompt as it is, or with --chat the
    conversation (one user turn, or --messages FILE) through the run's chat template, ready for the
    assistant (moelab.data.chat)."""
    from moelab.data.chat import ChatTemplate, problem

    if not args.chat:
        if args.messages:
            raise UsageError("--messages: only with --chat")
        if args.prompt is None:
            raise UsageError("--prompt: give the text to continue (or --chat with --prompt or --messages)")
        return args.prompt, []
    if (args.prompt is None) == (args.messages is None):
        raise UsageError("--chat: give one of --prompt TEXT (one user turn) or --messages FILE (a conversation)")
    if args.messages:
        try:
            data = json.loads(Path(args.messages).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise UsageError(f"--messages {args.messages}: not a readable JSON file ({exc})") from None
        messages = data.get("messages") if isinstance(data, dict) else data
        if not isinstance(messages, list) or not messages:
            raise UsageError(f'--messages {args.messages}: give {{"messages": [{{"role", "content"}}, ...]}}')
    else:
        messages = [{"role": "user", "content": args.prompt}]
    if (why := problem([*messages, {"role": "assistant", "content": ""}])) is not None:
        raise UsageError(f"--messages {args.messages}: {why}" if args.messages else f"--prompt: {why}")
    tpl = ChatTemplate.for_tokenizer(cfg.data.tokenizer)
    return tpl.render(messages, add_generation_prompt=True), tpl.ends


def cmd_sample(args: argparse.Namespace) -> int:
    from tokenizers import Tokenizer

    from moelab.config import final_model
    from moelab.export import checkpoint_step, load_trained, tokenizer_of
    from moelab.model.decode import Generator, check_sampling
    from moelab.runs import load_run_config

    check_sampling(args.temperature, args.top_k, args.top_p, args.max_new_tokens, args.seed)
    cfg = load_run_config(args.run_dir)  # bad input is refused in one line before anything loads
    text_in, stops = _prompt_text(args, cfg)
    step = checkpoint_step(args.run_dir, args.checkpoint)
    tok = Tokenizer.from_file(str(tokenizer_of(args.run_dir, cfg)))
    prompt = tok.encode(text_in).ids
    if len(prompt) > cfg.model.seq_len:
        raise UsageError(
            f"--prompt: {len(prompt)} tokens, the model's context is {cfg.model.seq_len}: shorten the prompt"
        )
    stop = tok.token_to_id("<|endoftext|>")
    _say(f"loading {args.run_dir} at step {step} ...")
    t = load_trained(args.run_dir, step)
    gen = Generator(t.params, t.model_state, final_model(t.cfg))  # the last phase's context and RoPE
    stream = sys.stdout.isatty() and not args.json and not args.chat  # a reply is printed without its end marker
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

    def turn_ended(new: list[int]) -> bool:  # --chat: the template's end of the assistant's turn
        return any(x in tok.decode(new) for x in stops)

    out, _ = gen.generate(prompt, args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed, stop,
                          on_token, until=turn_ended if stops else None)  # fmt: skip
    seconds = time.perf_counter() - t0
    text = tok.decode(out)
    for x in stops:  # the reply, without the marker that ends it
        text = text.split(x)[0]
    if args.json:
        print(
            json.dumps(
                {
                    "step": step,
                    "prompt": args.prompt,
                    "rendered": text_in if args.chat else None,
                    "text": text,
                    "tokens": out,
                    "seconds": seconds,
                },
                indent=1,
            )  # fmt: skip
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
    p.add_argument("--prompt", help="the text to continue (with --chat: the user's turn)")
    p.add_argument(
        "--chat",
        action="store_true",
        help="apply the run's chat template (its tokenizer's, else moelab's own) to --prompt as one user turn, or to "
        "--messages, and print the assistant's reply, up to the end of its turn",
    )
    p.add_argument(
        "--messages", metavar="FILE", help='with --chat: a conversation, {"messages": [{"role", "content"}, ...]}'
    )
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
