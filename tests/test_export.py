"""The transformers export's padded batches, KV cache and RoPE scaling (issue 28).

Real tokens of a left- or right-padded batch get their unpadded logits (moelab's, within 1e-4);
``generate()`` with its cache gives the tokens and step logits of ``generate()`` without; the torch
RoPE frequencies are moelab's for every scaling, and a model exported with scaled RoPE still gives
moelab's logits. torch runs on one thread: these are tiny ops, and two threads on a busy 2-core
machine spin for seconds.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moelab.cli import main
from moelab.config import final_model, replace
from moelab.export import load_trained
from moelab.model.transformer import forward, logits_of

ATOL = 1e-4


@pytest.fixture(scope="module")
def torch1():
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield torch
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def exported(tiny_run, tmp_path_factory, torch1):
    """The tiny run exported with `moelab export hf` and loaded by transformers; and the run itself."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("export") / "hf"
    assert main(["export", "hf", str(tiny_run), "--out", str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True).eval()
    return model, load_trained(tiny_run), out


def moelab_logits(params, state, m, rows: list[list[int]]) -> list[np.ndarray]:
    """moelab's logits for each row alone, from one batch padded at the end (causal: the padding is
    after every real token; dropless: routing is per token)."""
    width = max(map(len, rows))
    batch = np.zeros((len(rows), width), np.int32)
    for r, row in enumerate(rows):
        batch[r, : len(row)] = row
    run = jax.jit(lambda p, s, x: logits_of(p, forward(p, s, x, m, "dropless")[0]))
    out = np.asarray(run(params, state, jnp.asarray(batch)))
    return [out[r, : len(row)] for r, row in enumerate(rows)]


def padded(rows: list[list[int]], width: int, side: str, rng) -> tuple[np.ndarray, np.ndarray]:
    """Rows padded to ``width`` on ``side`` with random token ids, and the mask (1 = a real token)."""
    ids = rng.integers(0, 512, (len(rows), width))
    mask = np.zeros((len(rows), width), np.int64)
    for r, row in enumerate(rows):
        cols = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[r, cols], mask[r, cols] = row, 1
    return ids, mask


def test_padded_batches_give_the_unpadded_logits(exported, torch1):
    """Left and right padding, rows of 60, 12 and 30 tokens (past the local window of 16) padded to 64
    and to 70 columns (wider than the context: positions count real tokens only): every real token's
    logits are moelab's for its row alone."""
    torch = torch1
    model, t, _ = exported
    rows = [list(range(5, 65)), list(range(100, 112)), list(range(200, 230))]
    ref = moelab_logits(t.params, t.model_state, t.cfg.model, rows)
    rng = np.random.default_rng(0)
    for width in (64, 70):
        for side in ("left", "right"):
            ids, mask = padded(rows, width, side, rng)
            with torch.no_grad():
                got = model(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
            for r in range(len(rows)):
                np.testing.assert_allclose(got[r][mask[r] == 1], ref[r], atol=ATOL, rtol=0, err_msg=f"{side} {r}")
    with torch.no_grad():  # unpadded, no mask
        np.testing.assert_allclose(model(torch.tensor([rows[0]])).logits[0].numpy(), ref[0], atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="65 tokens: the model's context is 64"):
        model(torch.tensor([list(range(65))]))


def test_cached_generate_equals_uncached(exported, torch1):
    """Greedy generate() of a left-padded batch: with the cache, each step after the prompt runs one
    token; the tokens and every step's logits equal generate() without a cache (which runs the whole
    sequence each step), and moelab's logits for each row alone."""
    torch = torch1
    model, t, _ = exported
    prompts = [list(range(5, 25)), list(range(300, 308))]
    ids, mask = padded(prompts, 20, "left", np.random.default_rng(1))
    widths: list[int] = []
    hook = model.model.register_forward_pre_hook(lambda mod, args: widths.append(args[0].shape[1]))
    runs = {}
    try:
        for cache in (True, False):
            widths.clear()
            with torch.no_grad():
                runs[cache] = model.generate(
                    torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=24, do_sample=False,
                    eos_token_id=None, use_cache=cache, return_dict_in_generate=True, output_logits=True,
                )  # fmt: skip
            runs[cache, "widths"] = list(widths)
    finally:
        hook.remove()
    assert runs[True, "widths"] == [20] + [1] * 23  # the cache kept: one new token a step
    assert runs[False, "widths"] == list(range(20, 44))
    assert runs[True].sequences.tolist() == runs[False].sequences.tolist()
    cached, uncached = (torch.stack(runs[c].logits, 1).numpy() for c in (True, False))  # [b, steps, vocab]
    np.testing.assert_allclose(cached, uncached, atol=ATOL, rtol=0)
    new = runs[True].sequences[:, 20:].tolist()
    ref = moelab_logits(t.params, t.model_state, t.cfg.model, [p + n for p, n in zip(prompts, new, strict=True)])
    for r, p in enumerate(prompts):
        np.testing.assert_allclose(cached[r], ref[r][len(p) - 1 : -1], atol=ATOL, rtol=0, err_msg=f"row {r}")


@pytest.mark.parametrize("kind", ["none", "pi", "ntk", "yarn"])
def test_torch_rope_frequencies_are_moelabs(kind, torch1):
    from moelab.export.remote_code.modeling_moelab import rope_frequencies as torch_freqs
    from moelab.model.layers import rope_frequencies

    for half, theta, base in ((8, 10000.0, 64), (32, 500000.0, 4096)):
        for factor in (1.0, 2.0, 8.0):
            want, want_scale = rope_frequencies(half, theta, (kind, factor, base))
            got, got_scale = torch_freqs(half, theta, (kind, factor, base))
            assert got.dtype == torch1.float64
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=0)
            assert got_scale == pytest.approx(want_scale, rel=1e-12)
            if kind != "none" and factor > 1:  # the scaling does something here
                assert not np.allclose(want, rope_frequencies(half, theta, ("none", 1.0, base))[0])


def test_scaled_rope_export_gives_moelabs_logits(exported, torch1):
    """The export's config carries the run's RoPE scaling (none here); the same weights with RoPE scaled
    from an original context of 16 (factor 4, each kind) give moelab's logits, left-padded too."""
    from moelab.export.hf import hf_config, hf_tensors
    from moelab.export.remote_code.configuration_moelab import MoelabConfig
    from moelab.export.remote_code.modeling_moelab import MoelabForCausalLM

    torch = torch1
    model, t, out = exported
    none = {"type": "none", "factor": 1.0, "original_max_position_embeddings": 64}
    assert json.loads((out / "config.json").read_text())["rope_scaling"] == none == model.config.rope_scaling
    row = list(range(7, 47))
    ids, mask = padded([row], 48, "left", np.random.default_rng(2))
    (plain,) = moelab_logits(t.params, t.model_state, t.cfg.model, [row])
    weights = None
    for kind in ("pi", "ntk", "yarn"):
        scaled = t._replace(cfg=replace(t.cfg, model={"rope_original_len": 16, "rope_scaling": kind}))
        config = hf_config(scaled, None)
        assert config["rope_scaling"] == {"type": kind, "factor": 4.0, "original_max_position_embeddings": 16}
        m = MoelabForCausalLM(MoelabConfig(**config)).eval()
        weights = weights or {k: torch.tensor(v) for k, v in hf_tensors(scaled).items()}
        m.load_state_dict(weights, strict=True)
        (ref,) = moelab_logits(t.params, t.model_state, final_model(scaled.cfg), [row])
        with torch.no_grad():
            got = m(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits[0].numpy()
        np.testing.assert_allclose(got[mask[0] == 1], ref, atol=ATOL, rtol=0, err_msg=kind)
        assert np.abs(plain - ref).max() > 1e-3  # the scaling changes the logits: a real check


def test_the_export_carries_the_chat_template(exported, torch1):
    """transformers' apply_chat_template on the export renders as `moelab sample --chat` does, and its greedy
    generate() from that prompt writes moelab's greedy tokens."""
    from transformers import AutoTokenizer

    from moelab.data.chat import ChatTemplate
    from moelab.model.decode import Generator

    model, t, out = exported
    hf = AutoTokenizer.from_pretrained(str(out))
    messages = [{"role": "user", "content": "x = "}]  # short: the tiny run's context is 64 tokens
    text = ChatTemplate.for_tokenizer(t.cfg.data.tokenizer).render(messages, add_generation_prompt=True)
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == text
    ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    ids = ids["input_ids"] if isinstance(ids, dict) else ids
    assert list(ids) == hf(text, add_special_tokens=False)["input_ids"]
    want, _ = Generator(t.params, t.model_state, final_model(t.cfg)).generate(list(ids), max_new=8)
    got = model.generate(torch1.tensor([list(ids)]), max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert got[0, len(ids) :].tolist() == want
