"""Using a trained run: `moelab sample`, `moelab export safetensors` and `moelab export hf`.

The HF tests load the exported directory in transformers (torch and transformers: the dev extra
installs them) and compare its logits and greedy tokens with moelab's; one fast logits check runs
by default, the full ones (two routers, greedy generation) are slow.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import MICRO
from moelab.cli import main
from moelab.config import load_config
from moelab.export import load_trained
from moelab.model.decode import Generator
from moelab.model.transformer import forward, logits_of
from moelab.train.loop import train

CONTEXT = ["model.seq_len=64"]  # room for a prompt and 32 new tokens


def _train(corpus, tmp_path_factory, preset, *more):
    out = tmp_path_factory.mktemp(preset) / "run"
    cfg = load_config(preset, [*MICRO, *CONTEXT, f"data.sources=[{corpus['code']}, {corpus['prose']}]",
                               "train.steps=10", "train.eval_every=10", *more])  # fmt: skip
    train(cfg, out, progress=False)
    return out


@pytest.fixture(scope="module")
def sigmoid_run(tiny_run):
    """The tiny preset (sigmoid router with its bias, latent experts, local and global layers): conftest's."""
    return tiny_run


@pytest.fixture(scope="module")
def softmax_run(corpus, tmp_path_factory):
    return _train(corpus, tmp_path_factory, "tiny-softmax", "model.sliding_window=0", "model.latent_dim=0")


def _full_logits(t, tokens):
    run = jax.jit(lambda p, s, x: logits_of(p, forward(p, s, x, t.cfg.model, "dropless")[0]))
    return np.asarray(run(t.params, t.model_state, jnp.asarray([tokens], jnp.int32)))[0]


def test_sample_greedy_follows_the_full_forward(sigmoid_run, capsys):
    """The CLI's greedy tokens are the argmax of the full forward over the growing sequence, and the run
    carries its own tokenizer."""
    assert (sigmoid_run / "tokenizer.json").is_file()
    args = ["sample", str(sigmoid_run), "--prompt", "def main(", "--temperature", "0", "--max-new-tokens", "12"]
    assert main([*args, "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    t = load_trained(sigmoid_run)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(t.tokenizer_path))
    prompt = tok.encode("def main(").ids
    seq = prompt + res["tokens"]
    ref = _full_logits(t, seq)
    for j, got in enumerate(res["tokens"]):
        assert got == int(np.argmax(ref[len(prompt) - 1 + j]))
    assert res["text"] == tok.decode(res["tokens"]) and res["step"] == 10
    # stdout not a terminal: the plain text and nothing else
    assert main(args) == 0
    assert capsys.readouterr().out == res["text"] + "\n"


def test_sampling_with_a_seed_is_repeatable(sigmoid_run, capsys):
    args = [
        "sample",
        str(sigmoid_run),
        "--prompt",
        "import",
        "--top-p",
        "0.9",
        "--top-k",
        "50",
        "--max-new-tokens",
        "8",
    ]
    outs = []
    for seed in ("1", "1", "2"):
        assert main([*args, "--seed", seed, "--json"]) == 0
        outs.append(json.loads(capsys.readouterr().out)["tokens"])
    assert outs[0] == outs[1] != outs[2]


def test_bad_input_is_one_line_and_exit_2(sigmoid_run, tmp_path, capsys):
    no_ckpt = tmp_path / "fresh"
    no_ckpt.mkdir()
    (no_ckpt / "config.json").write_text((sigmoid_run / "config.json").read_text())
    cases = [
        (["sample", str(no_ckpt), "--prompt", "x"], "no complete checkpoint"),
        (["sample", str(sigmoid_run), "--prompt", "x", "--checkpoint", "3"], "--checkpoint 3: no such checkpoint"),
        (["sample", str(sigmoid_run), "--prompt", "x = 1\n" * 40], "the model's context is 64"),
        (["sample", str(sigmoid_run), "--prompt", "x", "--top-p", "1.5"], "--top-p 1.5"),
        (["sample", str(tmp_path), "--prompt", "x"], "no config.json"),
        (["export", "safetensors", str(no_ckpt), "--out", str(tmp_path / "w.safetensors")], "no complete checkpoint"),
        (["export", "hf", str(sigmoid_run), "--out", str(sigmoid_run)], "already exists"),
        (
            ["export", "hf", str(sigmoid_run), "--out", str(tmp_path / "w.safetensors" / "such")],
            "is a file, not a folder",
        ),
    ]
    (tmp_path / "w.safetensors").write_text("not a folder")
    for args, msg in cases:
        capsys.readouterr()
        assert main(args) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0], (args, err)
    assert (tmp_path / "w.safetensors").read_text() == "not a folder"


def test_export_safetensors_holds_the_checkpoint_under_documented_names(sigmoid_run, tmp_path):
    from safetensors import safe_open

    from moelab.export.hf import SAFETENSORS_NAMES

    out = tmp_path / "new" / "weights.safetensors"  # its folder made, as `moelab train` makes its --out's
    assert main(["export", "safetensors", str(sigmoid_run), "--out", str(out), "--checkpoint", "10"]) == 0
    t = load_trained(sigmoid_run, 10)
    with safe_open(str(out), "np") as f:
        names = set(f.keys())
        meta = f.metadata()
        got = {k: f.get_tensor(k) for k in names}
    want = {"embed": t.params["embed"], "head": t.params["head"], "final_norm": t.params["final_norm"],
            "router_bias": t.model_state["router_bias"], **{f"layers.{k}": v for k, v in t.params["layers"].items()}}  # fmt: skip
    assert names == set(want)
    assert {n if not n.startswith("layers.") else "layers.NAME" for n in names} == set(SAFETENSORS_NAMES)
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], np.asarray(v))
    assert meta["step"] == "10" and json.loads(meta["config"])["model"]["router"] == "sigmoid"
    assert not np.all(got["router_bias"] == 0)  # the quantile bias moved: a real state, exported


def _hf(run, tmp_path):
    out = tmp_path / "hf"
    assert main(["export", "hf", str(run), "--out", str(out)]) == 0
    assert not list(tmp_path.glob(".hf.partial*"))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True)
    return model.eval(), AutoTokenizer.from_pretrained(str(out), trust_remote_code=True)


def test_exported_model_gives_moelabs_logits_fast(sigmoid_run, tmp_path):
    """The default run's version of the slow parity test below: the tiny run (sigmoid router with
    its bias, latent experts, local and global layers) exported and loaded in transformers gives
    moelab's logits on a sequence past the local window."""
    import torch

    model, _ = _hf(sigmoid_run, tmp_path)
    t = load_trained(sigmoid_run)
    seq = list(range(5, 30))  # 25 tokens: past the window of 16 on local layers
    with torch.no_grad():
        got = model(torch.tensor([seq])).logits[0].numpy()
    np.testing.assert_allclose(got, _full_logits(t, seq), atol=1e-4, rtol=1e-4)


@pytest.mark.slow  # imports torch and transformers (~15 s), two runs
@pytest.mark.parametrize("which", ["sigmoid_run", "softmax_run"])
def test_exported_model_gives_moelabs_logits_and_greedy_tokens(which, request, tmp_path):
    import torch

    run = request.getfixturevalue(which)
    model, tok = _hf(run, tmp_path)
    t = load_trained(run)
    text = "def parse(line):\n    return"
    ids = tok(text)["input_ids"]
    from tokenizers import Tokenizer

    assert ids == Tokenizer.from_file(str(t.tokenizer_path)).encode(text).ids  # the same tokenizer
    seq = ids + list(range(5, 40))  # past the window of 16 on local layers
    with torch.no_grad():
        got = model(torch.tensor([seq])).logits[0].numpy()
    np.testing.assert_allclose(got, _full_logits(t, seq), atol=1e-4, rtol=1e-4)
    # greedy: 32 tokens, the same in both (no stop token, so all 32 are compared)
    ours, _ = Generator(t.params, t.model_state, t.cfg.model).generate(ids, max_new=32)
    with torch.no_grad():
        theirs = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=None)
    assert theirs[0, len(ids) :].tolist() == ours
    assert len(ours) == 32
