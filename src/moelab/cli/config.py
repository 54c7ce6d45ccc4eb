"""`moelab` commands: the config: its parameters and FLOPs, the validated config, the presets."""

from __future__ import annotations

import argparse
import json
import textwrap

from moelab.cli.common import add_config_args
from moelab.config import load_config, to_dict
from moelab.errors import UsageError


def cmd_flops(args: argparse.Namespace) -> int:
    from moelab import accounting

    cfg = load_config(args.config, args.overrides)
    if args.tokens is not None and (args.steps is not None or args.batch_tokens is not None):
        raise UsageError("--tokens: give either --tokens or --steps with --batch-tokens, not both")
    if args.tokens is not None:
        tokens = args.tokens
    elif args.steps is not None or args.batch_tokens is not None:
        for flag, v in (("--steps", args.steps), ("--batch-tokens", args.batch_tokens)):
            if v is not None and v <= 0:
                raise UsageError(f"{flag}: must be > 0, got {v}")
        steps = args.steps if args.steps is not None else cfg.train.steps
        batch_tokens = args.batch_tokens if args.batch_tokens is not None else cfg.train.batch_size * cfg.model.seq_len
        tokens = steps * batch_tokens
    else:
        tokens = accounting.run_tokens(cfg)
    if tokens <= 0:
        raise UsageError(f"--tokens: must be > 0, got {tokens:g}")
    # the run's own tokens: a long-context phase counted at its length; other token counts at model.seq_len
    out = accounting.run_train(cfg) if tokens == accounting.run_tokens(cfg) else accounting.count(cfg).train(tokens)
    out["config"] = cfg.name or args.config
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    h = accounting.human
    rows = [
        ("total parameters", h(out["total_params"])),
        ("  without embeddings and head", h(out["total_params_nonembedding"])),
        ("active parameters (Marin)", h(out["active_params"])),
        ("  with embeddings and head", h(out["active_params_with_embeddings"])),
        ("norm parameters (not counted)", h(out["norm_params"])),
        ("forward FLOPs / token", f"{out['forward_flops_per_token']:.4g}"),
        ("  without LM head", f"{out['forward_flops_per_token_without_lm_head']:.4g}"),
        ("tokens", f"{out['tokens']:.4g}"),
        ("training FLOPs (3 x forward)", f"{out['train_flops']:.4g}"),
        ("  without LM head", f"{out['train_flops_without_lm_head']:.4g}"),
        ("6 N D", f"{out['six_n_d']:.4g}"),
    ]
    print(f"{out['config']}")
    for name, value in rows:
        print(f"  {name:<32} {value:>12}")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from moelab.config import ConfigError, config_hash
    from moelab.model.transformer import backend_problems

    if args.explain is not None:
        return explain_field(args)
    if args.config is None:
        raise UsageError("config: give a preset name or a config file (or --explain FIELD for a field's meaning)")
    cfg = load_config(args.config, args.overrides)
    if problems := cfg.check_vocab() + backend_problems(cfg.model):  # what training would refuse, refused here
        raise ConfigError(problems)
    out = {"hash": config_hash(cfg), **to_dict(cfg)}  # `moelab config`, train, plan and ladder read it back as it is
    if args.yaml:
        import yaml

        print(yaml.safe_dump(out, sort_keys=False), end="")
    else:
        print(json.dumps(out, indent=1))
    return 0


def explain_field(args: argparse.Namespace) -> int:
    """`moelab config [CONFIG] --explain FIELD`: a field's type, default (and the config's value) and
    meaning, or a section's fields one line each; all from the fields themselves (moelab.config.explain)."""
    from moelab.config import explain, show_value, summary

    info = explain(args.explain)  # an unknown name: one line with the nearest names, before any config is read
    cfg = load_config(args.config, args.overrides) if args.config is not None else None
    label = (cfg.name or args.config) if cfg is not None else ""

    def value_in(name: str):
        node = cfg
        for part in name.split("."):
            node = getattr(node, part)
        return node

    if "fields" in info:  # a section
        print(f"{info['name']}: {info['help']}")
        rows = [(f["name"].split(".", 1)[1], value_in(f["name"]) if cfg else f["default"], f) for f in info["fields"]]
        print(
            f"  ({'values in ' + label if cfg else 'defaults'}; moelab config --explain {info['name']}.FIELD for more)"
        )
        width = max(len(r[0]) for r in rows)
        for key, value, f in rows:
            shown = show_value(value)
            shown = shown if len(shown) <= 16 else shown[:15] + "…"
            print(f"  {key:<{width}}  {shown:<16}  {summary(f['help'])}")
        return 0
    print(f"{info['name']} ({info['type']})")
    print(f"  default: {show_value(info['default'])}")
    if cfg is not None:
        print(f"  in {label}: {show_value(value_in(info['name']))}")
    if "choices" in info:
        print(f"  choices: {', '.join(show_value(c) for c in info['choices'])}")
    print(textwrap.fill(info["help"], 100, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False))
    return 0


def cmd_presets(args: argparse.Namespace) -> int:
    from moelab import accounting
    from moelab.presets import ABOUT, PRESETS

    for name in PRESETS:
        a = accounting.count(load_config(name))
        h = accounting.human
        print(f"{name:<20} total {h(a.total_params):>8}  active {h(a.active_params):>8}  {ABOUT.get(name, '')}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("flops", help="parameters and FLOPs of a config, by Marin's definitions")
    add_config_args(p)
    p.add_argument("--steps", type=int, help="training steps (default: the config's train.steps)")
    p.add_argument("--batch-tokens", type=int, help="tokens per step (default: batch_size x seq_len)")
    p.add_argument("--tokens", type=float, help="total training tokens, instead of --steps/--batch-tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_flops)

    p = sub.add_parser(
        "config",
        help="print a validated config as JSON (or --yaml), with its hash; or what a field means (--explain)",
        description="Print a validated config as JSON (or YAML), with its hash: `moelab config`, train, plan and "
        "ladder read it back as it is. With --explain FIELD, print what a field means instead.",
    )
    add_config_args(p, optional=" (optional with --explain)")
    p.add_argument("--yaml", action="store_true", help="print YAML instead of JSON")
    p.add_argument(
        "--explain",
        metavar="FIELD",
        help="print a field's type, default (and its value in the config given) and meaning, such as model.top_k; "
        "a section name (model, train, data, mesh) lists its fields",
    )
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("presets", help="list the named configs: total and active parameters, what each is")
    p.set_defaults(func=cmd_presets)
