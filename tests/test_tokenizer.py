"""The store's tokenizer (moelab.data.tokenizer): pretrained tokenizers keep their own BOS/EOS (by the
rule in the module's docstring), documents are [bos] + ids + [eos] with nothing doubled or added,
bytes per token add up to the text's bytes, and bad input is one line naming the file.

Every tokenizer here is made in the test (tiny BPEs and word-level vocabularies with the special tokens
and configuration files of Llama 2, Llama 3 and GPT-NeoX), so nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from moelab.data import tokenizer as T
from moelab.errors import DataError

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "import os\nprint(os.path.join('a', 'b'))\n",
    "Grüße aus Köln: café, naïve, résumé.",
    "for i in range(10):\n    total += i * i\n",
] * 8
DOCS = [
    "def mul(a, b):\n    return a * b\n",
    "The lazy dog sleeps.",
    "",  # an empty document is still one: [bos] [eos]
    "Grüße — ½ ∑ λ 日本語 🙂 café",
    "x",
]


def byte_level_bpe(specials: list[str], vocab_size: int = 300) -> Tokenizer:
    """A tiny byte-level BPE (as GPT-2/NeoX and Llama 3 are) whose special tokens are ``specials``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def metaspace_byte_fallback(prepend: bool) -> Tokenizer:
    """A tiny SentencePiece-style BPE as Llama 2's tokenizer.json has it: <unk> <s> </s>, the 256
    byte-fallback pieces <0x00>..<0xFF>, then pieces with ▁ for a space. ``prepend``: Llama 2's own
    normalizer (▁ put before each text, spaces replaced); else a Metaspace pre-tokenizer that adds none."""
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    base.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=120, show_progress=False))
    trained = json.loads(base.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    if prepend:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tok


def write(folder: Path, tok: Tokenizer, **configs) -> Path:
    """A model folder: tokenizer.json and the configuration files given (name without .json -> dict)."""
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    for name, cfg in configs.items():
        (folder / f"{name}.json").write_text(json.dumps(cfg))
    return folder


def check_documents(tok: T.Tok, texts: list[str] = DOCS) -> list[list[int]]:
    """encode() (and encode_batches()) against a plain reference built document by document."""
    head = [tok.bos] if tok.add_bos else []
    expect = [head + tok.tokenizer.encode(t, add_special_tokens=False).ids + [tok.eos] for t in texts]
    flat, counts = T.encode(tok, texts)
    assert flat.dtype == np.uint32 and flat.ndim == 1 and counts.dtype == np.int64
    assert counts.tolist() == [len(e) for e in expect]
    assert flat.tolist() == [i for e in expect for i in e]
    batches = [("a", texts[:2]), ("b", texts[2:]), ("c", [])]
    got = [(k, f.tolist(), c.tolist()) for k, f, c in T.encode_batches(tok, batches)]
    assert [k for k, _, _ in got] == ["a", "b", "c"]
    assert [i for _, f, _ in got for i in f] == flat.tolist() and sum((c for _, _, c in got), []) == counts.tolist()
    return expect


def docs_of(tok: T.Tok, texts: list[str] = DOCS) -> list[list[int]]:
    flat, counts = T.encode(tok, texts)
    return [a.tolist() for a in np.split(flat, np.cumsum(counts)[:-1])]


# -- where BOS/EOS come from ------------------------------------------------------------------------


def test_llama2_style_config_bos_eos_and_add_bos_token(tmp_path):
    """<s>/</s> named by tokenizer_config.json (one as a transformers AddedToken dict), add_bos_token
    true, and Llama 2's template putting <s> first: each document is <s> ids </s>, once each, and the
    tokenizer is used as it is (no token added)."""
    raw = metaspace_byte_fallback(prepend=True)
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    folder = write(
        tmp_path / "llama2",
        raw,
        tokenizer_config={
            "add_bos_token": True,
            "add_eos_token": False,
            "bos_token": {"content": "<s>", "lstrip": False, "normalized": False, "__type": "AddedToken"},
            "eos_token": "</s>",
            "unk_token": "<unk>",
        },
        special_tokens_map={"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    )
    tok = T.load(folder, 10_000)
    assert (tok.bos, tok.eos, tok.pad, tok.add_bos, tok.added_eot) == (1, 2, None, True, False)
    assert tok.vocab_size == Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size()
    assert "tokenizer_config.json" in tok.origin and "add_bos_token" in tok.origin
    for doc, text in zip(docs_of(tok), DOCS, strict=True):
        assert doc[0] == 1 and doc[-1] == 2 and doc.count(1) == 1 and doc.count(2) == 1, (text, doc)
    check_documents(tok)
    # add_bos_token false wins over the template: no bos, eos still </s>
    cfg = json.loads((folder / "tokenizer_config.json").read_text()) | {"add_bos_token": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = T.load(folder, 10_000)
    assert (tok.bos, tok.add_bos, tok.eos) == (1, False, 2)
    assert all(d[0] != 1 and d[-1] == 2 for d in docs_of(tok))


def llama3(tmp_path: Path, **configs) -> Path:
    raw = byte_level_bpe(["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"])
    bot = raw.token_to_id("<|begin_of_text|>")
    raw.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bot)]),
        ]
    )
    return write(tmp_path / "llama3", raw, **configs)


def test_llama3_style_bos_from_template_not_doubled(tmp_path):
    """Llama 3: eos <|end_of_text|> named by tokenizer_config.json, no bos_token or add_bos_token:
    bos is the <|begin_of_text|> the post-processor puts first, once per document."""
    folder = llama3(tmp_path, tokenizer_config={"eos_token": "<|end_of_text|>"})
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    bot, eot = raw.token_to_id("<|begin_of_text|>"), raw.token_to_id("<|end_of_text|>")
    assert raw.encode("x").ids[0] == bot  # (the template does put it first)
    tok = T.load(folder, 300)
    assert (tok.bos, tok.eos, tok.add_bos, tok.added_eot) == (bot, eot, True, False)
    assert tok.vocab_size == raw.get_vocab_size() and raw.token_to_id(T.EOT) is None
    assert tok.tokenizer.token_to_id(T.EOT) is None
    assert "post-processor" in tok.origin
    for doc in docs_of(tok):
        assert doc[0] == bot and doc.count(bot) == 1 and doc[-1] == eot and doc.count(eot) == 1
    check_documents(tok)
    # the tokenizer.json alone (no configuration): eos found by name, bos still from the template
    alone = T.load(folder / "tokenizer.json", 300)
    assert (alone.bos, alone.eos, alone.add_bos, alone.added_eot) == (bot, eot, True, False)


def test_gpt_neox_style_end_of_text_in_vocab_no_config(tmp_path):
    """GPT-NeoX: <|endoftext|> is a special token of the tokenizer (not id 0), no configuration: it
    is eos, there is no bos, and nothing is added."""
    raw = byte_level_bpe(["<|padding|>", "<|endoftext|>"])
    raw.add_tokens([AddedToken("    ", normalized=False)])  # NeoX's runs of spaces: added, not special
    path = tmp_path / "neox.json"
    raw.save(str(path))
    tok = T.load(path, 400)
    eot = raw.token_to_id("<|endoftext|>")
    assert eot == 1
    assert (tok.eos, tok.bos, tok.pad, tok.add_bos, tok.added_eot) == (eot, None, None, False, False)
    assert tok.vocab_size == raw.get_vocab_size() and "well-known" in tok.origin
    for doc in docs_of(tok):
        assert doc.count(eot) == 1 and doc[-1] == eot
    check_documents(tok)


def test_no_end_token_adds_endoftext(tmp_path):
    """A tokenizer with no end-of-text token (and one whose </s> is ordinary text, not a special
    token): <|endoftext|> is added after its last id, and said."""
    vocab = {"<unk>": 0, "hello": 1, "world": 2, "</s>": 3}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.add_special_tokens(["<unk>"])
    path = tmp_path / "tokenizer.json"
    raw.save(str(path))
    tok = T.load(path, 5)
    assert (tok.eos, tok.bos, tok.add_bos, tok.added_eot) == (4, None, False, True)
    assert tok.vocab_size == 5 and tok.tokenizer.id_to_token(4) == T.EOT and "added" in tok.origin
    assert docs_of(tok, ["hello world", "hello </s> x"]) == [[1, 2, 4], [1, 3, 0, 4]]
    check_documents(tok, ["hello world", "", "world world hello"])
    with pytest.raises(DataError, match=r"5 tokens \(with the <\|endoftext\|> added\), more than model.vocab_size=4"):
        T.load(path, 4)


def test_special_tokens_map_and_pad(tmp_path):
    """special_tokens_map.json counts when tokenizer_config.json names nothing; tokenizer_config.json
    wins when both do; pad comes from them, and one the tokenizer lacks is left out, not an error."""
    raw = byte_level_bpe(["<unk>", "<s>", "</s>", "<pad>", "<|endoftext|>"])
    ids = {n: raw.token_to_id(n) for n in ("<s>", "</s>", "<pad>", "<|endoftext|>")}
    folder = write(
        tmp_path / "m",
        raw,
        tokenizer_config={"model_max_length": 2048},
        special_tokens_map={"bos_token": "<s>", "eos_token": {"content": "</s>"}, "pad_token": "<pad>"},
    )
    tok = T.load(folder, 300)
    assert (tok.bos, tok.eos, tok.pad, tok.add_bos) == (ids["<s>"], ids["</s>"], ids["<pad>"], False)
    assert "special_tokens_map.json" in tok.origin
    check_documents(tok)
    write(folder, raw, tokenizer_config={"eos_token": "<|endoftext|>", "pad_token": "<nope>"})
    tok = T.load(folder, 300)
    assert (tok.eos, tok.pad) == (ids["<|endoftext|>"], None) and "'<nope>'" in tok.origin


def test_transformers_export(tmp_path):
    """A folder written by transformers' save_pretrained (whatever files its version writes)."""
    transformers = pytest.importorskip("transformers")
    raw = byte_level_bpe(["<unk>", "<s>", "</s>", "<pad>"])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.add_bos_token = True  # (transformers 5 writes it into the post-processor; 4 into tokenizer_config.json)
    folder = tmp_path / "hf"
    fast.save_pretrained(str(folder))
    tok = T.load(folder, 300)
    ids = {n: raw.token_to_id(n) for n in ("<s>", "</s>", "<pad>")}
    assert (tok.bos, tok.eos, tok.pad, tok.added_eot) == (ids["<s>"], ids["</s>"], ids["<pad>"], False)
    assert tok.vocab_size == raw.get_vocab_size()
    hf_ids = fast("def f(): pass").input_ids
    if hf_ids[0] == ids["<s>"]:  # transformers prepends it: so do we, once
        assert tok.add_bos and docs_of(tok, ["def f(): pass"])[0] == hf_ids + [ids["</s>"]]
    check_documents(tok)


# -- training, saving, the cache key ----------------------------------------------------------------


def test_train_save_and_load_saved(tmp_path):
    tok = T.train(CORPUS, 300)
    assert (tok.eos, tok.bos, tok.add_bos, tok.added_eot) == (0, None, False, False)
    assert tok.tokenizer.id_to_token(0) == T.EOT and tok.vocab_size <= 300
    check_documents(tok)
    for made in (tok, T.load(llama3(tmp_path, tokenizer_config={"eos_token": "<|end_of_text|>"}), 300)):
        store = tmp_path / f"store-{made.eos}"
        store.mkdir()
        T.save(made, store)
        back = T.load_saved(store)
        fields = ("eos", "bos", "pad", "add_bos", "added_eot", "origin", "vocab_size")
        assert [getattr(back, f) for f in fields] == [getattr(made, f) for f in fields]
        assert T.encode(back, DOCS)[0].tolist() == T.encode(made, DOCS)[0].tolist()
    old = tmp_path / "old-store"  # a store from before tokenizer_moelab.json: <|endoftext|> ends documents
    old.mkdir()
    tok.tokenizer.save(str(old / "tokenizer.json"))
    back = T.load_saved(old)
    assert (back.eos, back.bos, back.add_bos) == (0, None, False)


def test_fingerprint_follows_the_files_that_decide(tmp_path):
    folder = llama3(tmp_path, tokenizer_config={"eos_token": "<|end_of_text|>"})
    first = T.fingerprint(folder)
    assert first == T.fingerprint(folder) and len(first) == 64
    assert T.fingerprint(folder / "tokenizer.json") != first  # the file alone: its configuration does not count
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot_id|>"}))
    second = T.fingerprint(folder)
    assert second != first
    (folder / "special_tokens_map.json").write_text("{}")
    assert T.fingerprint(folder) != second
    (folder / "README.md").write_text("not part of the tokenizer")
    assert T.fingerprint(folder) == T.fingerprint(folder)


# -- bytes per token --------------------------------------------------------------------------------

TEXTS = ["plain ascii text, with  two spaces\nand a newline", "Grüße aus Köln — ½ ∑ λ 日本語 🙂 café naïve"]


def test_byte_lengths_byte_level_bpe(tmp_path):
    """Byte-level BPE (trained here, and NeoX-like with a non-special added token): a document's
    tokens add up to its UTF-8 bytes; special tokens are 0."""
    for tok in (T.train(CORPUS, 300), T.load(_neox(tmp_path), 400)):
        lengths = T.byte_lengths(tok)
        assert len(lengths) == tok.vocab_size and lengths[tok.eos] == 0
        for text in TEXTS + ["x" + "    " * 3 + "y"]:
            ids = tok.tokenizer.encode(text, add_special_tokens=False).ids
            assert int(lengths[ids].sum()) == len(text.encode()), text


def _neox(tmp_path: Path) -> Path:
    raw = byte_level_bpe(["<|padding|>", "<|endoftext|>"])
    raw.add_tokens([AddedToken("    ", normalized=False)])
    raw.save(str(tmp_path / "neox.json"))
    return tmp_path / "neox.json"


def test_byte_lengths_metaspace_and_byte_fallback(tmp_path):
    """SentencePiece-style pieces: ▁ is a space, <0xE6> is one byte, <s> </s> <unk> are 0. With a
    Metaspace that prepends nothing the tokens add up to the text's bytes exactly; Llama 2's normalizer
    puts a ▁ before each text, which counts one byte more per document (as documented)."""
    tok = T.load(write(tmp_path / "sp", metaspace_byte_fallback(prepend=False)), 1000)
    lengths = T.byte_lengths(tok)
    assert lengths[:3].tolist() == [0, 0, 0] and (lengths[3 : 3 + 256] == 1).all()
    pieces = tok.tokenizer.get_vocab()
    assert any(p.startswith("▁") and len(p) > 1 and lengths[i] == len(p.encode()) - 2 for p, i in pieces.items())
    for text in TEXTS:
        ids = tok.tokenizer.encode(text, add_special_tokens=False).ids
        if not text.isascii():
            assert any(3 <= i < 3 + 256 for i in ids)  # (the test does reach the byte fallback)
        assert int(lengths[ids].sum()) == len(text.encode()), text
    llama2 = T.load(write(tmp_path / "l2", metaspace_byte_fallback(prepend=True)), 1000)
    lengths = T.byte_lengths(llama2)
    for text in TEXTS:
        ids = llama2.tokenizer.encode(text, add_special_tokens=False).ids
        assert int(lengths[ids].sum()) == len(text.encode()) + 1, text


# -- bad input: one line naming the file ------------------------------------------------------------


def test_bad_tokenizers_are_one_line_naming_the_file(tmp_path):
    good = llama3(tmp_path, tokenizer_config={"eos_token": "<|end_of_text|>"})
    (tmp_path / "empty").mkdir()
    (tmp_path / "garbage.json").write_text("{not json")
    (tmp_path / "other.json").write_text(json.dumps({"version": "1.0", "model": {"type": "Nope"}}))
    noeos = write(tmp_path / "noeos", Tokenizer.from_file(str(good / "tokenizer.json")))
    (noeos / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    nobos = write(tmp_path / "nobos", Tokenizer.from_file(str(good / "tokenizer.json")))
    (nobos / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>"}))
    badcfg = write(tmp_path / "badcfg", Tokenizer.from_file(str(good / "tokenizer.json")))
    (badcfg / "tokenizer_config.json").write_text("[1, 2")
    cases = {
        tmp_path / "missing": ("missing", "no such tokenizer file or folder"),
        tmp_path / "empty": ("empty", "no tokenizer.json in this folder"),
        tmp_path / "garbage.json": ("garbage.json", "not a readable tokenizer.json"),
        tmp_path / "other.json": ("other.json", "not a readable tokenizer.json"),
        noeos: ("noeos/tokenizer_config.json", "eos_token '</s>' is not in the vocabulary"),
        nobos: ("nobos/special_tokens_map.json", "bos_token '<s>' is not in the vocabulary"),
        badcfg: ("badcfg/tokenizer_config.json", "not readable JSON"),
        good: ("llama3/tokenizer.json", "more than model.vocab_size=100; set model.vocab_size to"),
    }
    for spec, (name, says) in cases.items():
        with pytest.raises(DataError) as err:
            T.load(spec, 100)
        msg = str(err.value)
        assert "\n" not in msg and name in msg and says in msg, msg
    for spec in (tmp_path / "missing", tmp_path / "empty"):  # the cache key says the same
        with pytest.raises(DataError, match="tokenizer"):
            T.fingerprint(spec)
    with pytest.raises(DataError, match="add_bos_token is true but no bos_token"):
        raw = byte_level_bpe(["<|endoftext|>"])
        T.load(write(tmp_path / "addbos", raw, tokenizer_config={"add_bos_token": True}), 300)
    with pytest.raises(DataError, match=r"tokenizer_config.json: add_bos_token is 'yes'"):
        T.load(write(tmp_path / "addbos", raw, tokenizer_config={"add_bos_token": "yes"}), 300)
    with pytest.raises(DataError, match=r"empty: no tokenizer.json"):
        T.load_saved(tmp_path / "empty")
