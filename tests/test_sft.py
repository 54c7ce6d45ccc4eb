"""Conversations as training data (data.text_field: messages): the store keeps a loss mask that covers
exactly the assistant's tokens, batches carry it, the step's loss and the held-out loss count only
those tokens, and a bad conversation is refused naming file:line or skipped and counted."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import MICRO
from moelab.config import load_config
from moelab.data.mixture import batch_at, build_mixture
from moelab.data.store import build_store
from moelab.errors import ConfigError, DataError
from moelab.model.layers import document_segments
from moelab.model.transformer import forward, logits_of
from moelab.train import optim
from moelab.train.evaluate import eval_windows
from moelab.train.step import init_train_state, make_train_step

TWO_TURNS = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "2 + 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "And 10 + 20?"},
    {"role": "assistant", "content": "It is 30."},
]


def _chat_file(tmp_path, bad_line=None):
    rng = np.random.default_rng(0)
    rows = [{"messages": TWO_TURNS}]
    for _ in range(200):
        a, b = (int(x) for x in rng.integers(0, 100, 2))
        rows.append({"messages": [{"role": "user", "content": f"{a} + {b}?"},
                                  {"role": "assistant", "content": f"{a + b}"}]})  # fmt: skip
    lines = [json.dumps(r) for r in rows]
    if bad_line is not None:
        lines.insert(3, bad_line)
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _config(path, *more):
    sets = [*MICRO, f"data.sources=[{path}]", "data.text_field=messages", "model.seq_len=32", "train.steps=4", *more]
    return load_config("tiny", sets)


def test_the_loss_mask_covers_exactly_the_assistant_tokens(tmp_path, monkeypatch):
    monkeypatch.setenv("MOELAB_CACHE", str(tmp_path / "cache"))
    cfg = _config(_chat_file(tmp_path), "data.held_out_fraction=0.0")
    store = build_store(cfg.data, cfg.model.vocab_size, progress=False)
    tok = store.tokenizer()
    ids, mask = np.asarray(store.stream("chat", "train")), np.asarray(store.mask("chat", "train"))
    first = ids[: int(np.flatnonzero(ids == store.eot)[0]) + 1]  # the two-turn conversation, with its eot
    m = mask[: len(first)].astype(bool)

    def text(sel):
        return tok.decode(first[sel].tolist(), skip_special_tokens=False)

    # by hand: the assistant's words and the marker that ends each of its turns, nothing else
    assert text(m) == "5<|im_end|>\nIt is 30.<|im_end|>\n"
    assert text(~m) == (
        "<|im_start|>system\nYou add numbers.<|im_end|>\n<|im_start|>user\n2 + 3?<|im_end|>\n<|im_start|>assistant\n"
        "<|im_start|>user\nAnd 10 + 20?<|im_end|>\n<|im_start|>assistant\n<|endoftext|>"
    )
    # the template's markers were added to the tokenizer once, as one token each
    assert [tok.encode(x, add_special_tokens=False).ids for x in ("<|im_start|>", "<|im_end|>")] == [[1], [2]]
    # the runs of the mask: two assistant turns
    assert np.count_nonzero(np.diff(m.astype(int)) == 1) == 2


@pytest.mark.slow  # 13 s (make test under 15 minutes; CI's make test-all runs it)
def test_batches_carry_the_mask_and_the_loss_counts_only_the_assistant(tmp_path, monkeypatch):
    monkeypatch.setenv("MOELAB_CACHE", str(tmp_path / "cache"))
    cfg = _config(_chat_file(tmp_path))
    store = build_store(cfg.data, cfg.model.vocab_size, progress=False)
    mix = build_mixture(cfg, store, cfg.train.steps, cfg.train.seed)
    batch, _ = batch_at(store, mix, cfg.train.seed, 0, cfg.train.batch_size, cfg.model.seq_len)
    ids = np.where(batch < 0, -batch - 1, batch)
    stream, mask = np.asarray(store.stream("chat", "train")), np.asarray(store.mask("chat", "train"))
    for row, signs in zip(ids, batch >= 0, strict=True):  # each row is a window of the stream, its signs the mask
        at = next(i for i in range(len(stream) - len(row) + 1) if (stream[i : i + len(row)] == row).all())
        assert (signs == mask[at : at + len(row)].astype(bool)).all()
    assert 0 < (batch[:, 1:] >= 0).mean() < 1

    # the step's cross-entropy against a reference: the mean over the assistant's targets of the full
    # softmax's negative log-likelihood
    h = optim.hyper(cfg)
    opt = optim.make_optimizer(cfg, h)
    state = init_train_state(cfg, opt)
    step = make_train_step(cfg, opt, h, masked=True, eot=store.eot)
    segments = document_segments(jnp.asarray(ids[:, :-1]), store.eot)  # each conversation within itself
    hidden = forward(state["params"], state["model_state"], jnp.asarray(ids[:, :-1]), cfg.model, cfg.model.dispatch,
                     segments=segments)[0]  # fmt: skip
    logp = jax.nn.log_softmax(logits_of(state["params"], hidden).astype(jnp.float32), axis=-1)
    nll = -np.take_along_axis(np.asarray(logp), ids[:, 1:, None], axis=-1)[..., 0]
    counted = batch[:, 1:] >= 0
    _, got = step(jax.tree.map(jnp.copy, state), jnp.asarray(batch), jnp.int32(0))  # the step donates its state
    assert float(got["ce"]) == pytest.approx(float(nll[counted].mean()), rel=1e-5)
    # a target outside the loss changes nothing: other ids there (in the last column, a target and never an
    # input), the same cross-entropy; the same ids counted, another
    last = batch[:, -1] < 0
    assert last.any()
    other = batch.copy()
    other[last, -1] = -((ids[last, -1] + 7) % cfg.model.vocab_size) - 1
    _, again = step(jax.tree.map(jnp.copy, state), jnp.asarray(other), jnp.int32(0))
    assert float(again["ce"]) == float(got["ce"])
    other[last, -1] = -other[last, -1] - 1  # now counted
    _, counted_too = step(jax.tree.map(jnp.copy, state), jnp.asarray(other), jnp.int32(0))
    assert float(counted_too["ce"]) != float(got["ce"])

    # the held-out loss: the assistant's targets only
    rows, weights = eval_windows(store, "chat", cfg.model.seq_len, 256)
    held = np.asarray(store.mask("chat", "heldout"))
    start = np.flatnonzero(
        [(np.asarray(store.stream("chat", "heldout"))[i : i + rows.shape[1]] == rows[0]).all() for i in range(3)]
    )[0]
    assert (weights[0] == held[start + 1 : start + rows.shape[1]]).all() and 0 < weights.mean() < 1


def test_a_bad_conversation_is_refused_naming_file_and_line_or_skipped(tmp_path, monkeypatch):
    monkeypatch.setenv("MOELAB_CACHE", str(tmp_path / "cache"))
    path = _chat_file(tmp_path, bad_line=json.dumps({"messages": [{"role": "robot", "content": "beep"}]}))
    with pytest.raises(DataError, match=rf"{path}:4: message 0 has an unknown role 'robot'"):
        build_store(_config(path).data, 512, progress=False)
    store = build_store(_config(path, "data.bad_records=skip").data, 512, progress=False)
    assert store.manifest["bad_records"]["chat"]["chat.jsonl"]["records"] == 1


@pytest.mark.parametrize(
    "impl", ["blocked", pytest.param("flash", marks=pytest.mark.slow), pytest.param("xla", marks=pytest.mark.slow)]
)
def test_packing_never_lets_a_token_attend_across_a_document_boundary(impl):
    """Three documents packed in a row, each ended by the end of text: every position of each has the
    hidden state of that document run alone (dropless: a token's experts are its own), past the
    sliding window included; without segments the later documents differ."""
    eot = 0
    base = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=1, n_kv_heads_local=2, vocab_size=64, seq_len=48,
                sliding_window=6, global_every=2, n_routed=4, top_k=2, expert_dim=16, shared_dim=16,
                attention_impl=impl)  # fmt: skip
    m = load_config({"model": base}).model
    from moelab.model import init_params, init_state

    params, state = init_params(m, jax.random.PRNGKey(0)), init_state(m)
    rng = np.random.default_rng(1)
    docs = [list(rng.integers(1, 64, n)) for n in (9, 17, 12)]
    row = [t for d in docs for t in (*d, eot)]
    tokens = jnp.asarray([row], jnp.int32)
    run = jax.jit(lambda t, seg: forward(params, state, t, m, "dropless", segments=seg)[0])
    packed = np.asarray(run(tokens, document_segments(tokens, eot)))[0]
    plain = np.asarray(run(tokens, None))[0]
    at = 0
    for k, d in enumerate(docs):
        alone = np.asarray(run(jnp.asarray([d], jnp.int32), None))[0]
        np.testing.assert_allclose(packed[at : at + len(d)], alone, atol=2e-5, rtol=2e-5)
        if k:  # the unpacked row lets it see the documents before it
            assert np.abs(plain[at : at + len(d)] - alone).max() > 1e-3
        at += len(d) + 1


@pytest.mark.slow  # two more store builds: `make test-all` (CI) runs it
def test_conversations_come_in_every_container(tmp_path, monkeypatch):
    """The same conversations as gzipped JSON lines and as a Parquet column of lists of {role, content}:
    the same tokens and the same mask."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setenv("MOELAB_CACHE", str(tmp_path / "cache"))
    rows = [json.loads(x) for x in _chat_file(tmp_path).read_text().splitlines()]
    (tmp_path / "gz").mkdir()
    with gzip.open(tmp_path / "gz" / "chat.jsonl.gz", "wt") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"messages": [r["messages"] for r in rows]}), tmp_path / "pq" / "chat.parquet")
    got = []
    for path in (tmp_path / "gz" / "chat.jsonl.gz", tmp_path / "pq" / "chat.parquet"):
        cfg = _config(path, "data.held_out_fraction=0.0")
        store = build_store(cfg.data, cfg.model.vocab_size, progress=False)
        got.append((np.asarray(store.stream("chat", "train")), np.asarray(store.mask("chat", "train"))))
    assert (got[0][0] == got[1][0]).all() and (got[0][1] == got[1][1]).all() and got[0][1].any()


@pytest.mark.slow  # 12 s (make test under 15 minutes; CI's make test-all runs it)
def test_padded_rows_hold_one_conversation_each_and_lose_nothing_to_the_padding(tmp_path, monkeypatch):
    """data.packing padded: every row is one conversation from its start (a long one cut past the row),
    its mask as the store's, the rest padding outside the loss; a pass reads each conversation once; the
    step's cross-entropy is that of each conversation run alone (a reference without any padding), and
    the held-out loss reads the held-out conversations the same way."""
    monkeypatch.setenv("MOELAB_CACHE", str(tmp_path / "cache"))
    path = _chat_file(tmp_path)
    long = {
        "messages": [
            {"role": "user", "content": "count"},
            {"role": "assistant", "content": " ".join(map(str, range(60)))},
        ]
    }
    path.write_text(path.read_text() + json.dumps(long) + "\n")
    cfg = _config(path, "data.packing=padded", "data.held_out_fraction=0.1")
    store = build_store(cfg.data, cfg.model.vocab_size, progress=False)
    stream, mask, eot = np.asarray(store.stream("chat", "train")), np.asarray(store.mask("chat", "train")), store.eot
    ends = np.flatnonzero(stream == eot)
    docs = [(a, b) for a, b in zip(np.concatenate([[0], ends[:-1] + 1]), ends + 1, strict=True)]  # by hand
    mix = build_mixture(cfg, store, cfg.train.steps, cfg.train.seed)
    n, row = len(docs), cfg.model.seq_len + 1
    assert max(b - a for a, b in docs) > row  # the long conversation is there, and cut

    # a pass over the domain: each conversation once, each row one of them from its start
    seen = []
    steps = -(-n // cfg.train.batch_size)
    for s in range(steps):
        batch, _ = batch_at(store, mix, cfg.train.seed, s, cfg.train.batch_size, cfg.model.seq_len)
        for r in batch:
            ids = np.where(r < 0, -r - 1, r)
            k = next(
                i for i, (a, b) in enumerate(docs) if (stream[a : min(b, a + row)] == ids[: min(b - a, row)]).all()
            )
            a, b = docs[k]
            used = min(b - a, row)
            assert (ids[used:] == eot).all() and (r[used:] < 0).all()  # padding, outside the loss
            assert ((r[:used] >= 0) == mask[a : a + used].astype(bool)).all()
            seen.append(k)
    assert sorted(seen[:n]) == list(range(n))

    # the step against each conversation alone
    batch, _ = batch_at(store, mix, cfg.train.seed, 0, cfg.train.batch_size, cfg.model.seq_len)
    h = optim.hyper(cfg)
    opt = optim.make_optimizer(cfg, h)
    state = init_train_state(cfg, opt)
    nll, count = 0.0, 0
    for r in batch:
        used = int(np.flatnonzero(r >= 0).max()) + 1 if (r >= 0).any() else 1
        ids = np.where(r < 0, -r - 1, r)[:used]
        hidden = forward(state["params"], state["model_state"], jnp.asarray(ids[None, :-1]), cfg.model, "dropless")[0]
        logp = np.asarray(jax.nn.log_softmax(logits_of(state["params"], hidden).astype(jnp.float32), axis=-1))[0]
        counted = r[1:used] >= 0
        nll += float(-logp[np.arange(used - 1), ids[1:]][counted].sum())
        count += int(counted.sum())
    step = make_train_step(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dispatch="dropless")), opt, h,
                           masked=True, eot=None)  # fmt: skip
    _, got = step(jax.tree.map(jnp.copy, state), jnp.asarray(batch), jnp.int32(0))
    assert float(got["ce"]) == pytest.approx(nll / count, rel=1e-5)

    # held out: documents one a row, the mask as the store's
    rows, weights = eval_windows(store, "chat", cfg.model.seq_len, 10_000, padded=True)
    held, hmask = np.asarray(store.stream("chat", "heldout")), np.asarray(store.mask("chat", "heldout"))
    assert len(rows) == int((held == eot).sum())  # every held-out conversation, each once
    a = 0
    for r, w in zip(rows, weights, strict=True):
        b = a + int(np.flatnonzero(held[a:] == eot)[0]) + 1
        used = min(b - a, row)
        assert (r[:used] == held[a : a + used]).all() and (r[used:] == eot).all()
        assert (w[: used - 1] == hmask[a + 1 : a + used]).all() and not w[used - 1 :].any()
        a = b


def test_padded_rows_take_one_sequence_length():
    with pytest.raises(ConfigError, match="data.packing: padded takes one sequence length"):
        load_config("tiny", ["data.packing=padded", "data.phase_seq_lens=[64,128]", "data.phase_starts=[0.0,0.8]"])
    with pytest.raises(ConfigError, match="data.packing: must be packed or padded"):
        load_config("tiny", ["data.packing=pad"])
