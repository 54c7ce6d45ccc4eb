"""Sources, tokenizer, token store and mixture."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT
from moelab.cli import main
from moelab.config import load_config, replace
from moelab.data import readers as R
from moelab.data import sources as S
from moelab.data import store as store_mod
from moelab.data import tokenizer as T
from moelab.data.mixture import batch_at, batch_rows, build_mixture
from moelab.data.store import build_store, train_tokenizer


def test_tokenizer_round_trip_non_ascii():
    texts = ["def naïve(): return 'café'", "Grüße aus Köln — ½ ∑ λ 日本語 🙂", "plain ascii text"] * 20
    tok = train_tokenizer(texts, 400)
    for text in texts[:3] + ["unseen: ñandú ünïcödé 😀 ✓"]:
        assert tok.decode(tok.encode(text).ids) == text
    assert tok.token_to_id(store_mod.EOT) == 0


def test_stdlib_has_several_domains_with_documents():
    domains = S.resolve(["stdlib"])
    assert tuple(d.name for d in domains) == S.STDLIB_DOMAINS
    seen = {}
    for dom in domains:
        for doc in S.iter_documents(dom):
            seen[doc.domain] = seen.get(doc.domain, 0) + 1
    assert set(seen) == set(S.STDLIB_DOMAINS) and min(seen.values()) > 50


def test_held_out_split_is_a_function_of_the_name():
    ids = [f"doc{i}" for i in range(2000)]
    held = [S.is_held_out("d", i, 0.1) for i in ids]
    assert held == [S.is_held_out("d", i, 0.1) for i in reversed(ids)][::-1]
    assert 0.07 < np.mean(held) < 0.13


def data_cfg(corpus, *more):
    return load_config("tiny", [f"data.sources=[{corpus['code']}, {corpus['prose']}]", "model.vocab_size=512", *more])


def test_store_is_built_once_and_rebuilt_when_an_input_changes(corpus, tmp_path, monkeypatch):
    code = tmp_path / "code"
    code.mkdir()
    for p in Path(corpus["code"]).iterdir():
        (code / p.name).write_text(p.read_text())
    cfg = load_config("tiny", [f"data.sources=[{code}, {corpus['prose']}]", "model.vocab_size=512"])
    calls = []
    real = T.train
    monkeypatch.setattr(T, "train", lambda *a: calls.append(1) or real(*a))
    first = build_store(cfg.data, 512, cache=tmp_path / "cache", progress=False)
    again = build_store(cfg.data, 512, cache=tmp_path / "cache", progress=False)
    assert again.path == first.path and len(calls) == 1
    assert set(first.domains) == {"code", "prose"}
    for d in first.domains:  # every domain keeps documents in both splits
        assert len(first.stream(d, "train")) > 0 and len(first.stream(d, "heldout")) > 0
    (code / "textwrap.py").write_text((code / "textwrap.py").read_text() + "\n# changed\n")
    changed = build_store(cfg.data, 512, cache=tmp_path / "cache", progress=False)
    assert changed.path != first.path and len(calls) == 2
    # documents are stored in full, each followed by EOT
    tok = changed.tokenizer()
    doc = changed.documents()[0]
    ids = np.asarray(changed.tokens[doc["start"] : doc["start"] + doc["tokens"]])
    assert ids[-1] == changed.eot
    assert tok.decode(ids[:-1].tolist()) == (code / changed.doc_name(doc).split("#")[0]).read_text()


def test_jsonl_gz_and_parquet_sources(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"document number {i} with some words" for i in range(5)]
    gz = tmp_path / "notes.jsonl.gz"
    with gzip.open(gz, "wt") as fh:
        for t in texts:
            fh.write(json.dumps({"body": t}) + "\n")
    pq.write_table(pa.table({"body": texts}), tmp_path / "table.parquet")
    domains = S.resolve([str(gz), str(tmp_path / "table.parquet")], text_field="body")
    assert [d.name for d in domains] == ["notes", "table"]
    for dom in domains:
        assert [d.text for d in S.iter_documents(dom)] == texts


def _bad_inputs(tmp_path: Path) -> list[tuple[str, str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    empty = tmp_path / "empty"
    empty.mkdir()
    latin = tmp_path / "latin"
    latin.mkdir()
    (latin / "bad.txt").write_bytes("caf\xe9".encode("latin-1"))
    (latin / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0")
    notjson = tmp_path / "notjson.jsonl"
    notjson.write_text('{"text": "a"}\n{"text": "b"}\nnot json\n')
    nofield = tmp_path / "nofield.jsonl"
    nofield.write_text('{"text": "a"}\n{"body": "b"}\n')
    pq.write_table(pa.table({"text": [f"row {i} " * 50 for i in range(200)]}), tmp_path / "whole.parquet")
    data = (tmp_path / "whole.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2])
    return [
        (str(empty), f"{empty}: no files to read among 0 files"),
        (str(latin), f"{latin}: no UTF-8 text files among 2 files (2 binary or not UTF-8: bad.txt, image.png)"),
        (str(notjson), f"{notjson}:3: not valid JSON"),
        (str(nofield), f"{nofield}:2: no 'text' field"),
        (str(tmp_path / "cut.parquet"), f"{tmp_path / 'cut.parquet'}: not a readable parquet file"),
        (str(tmp_path / "missing"), f"{tmp_path / 'missing'}: no such file or directory"),
    ]


def test_bad_data_is_refused_with_one_line_and_nothing_left(tmp_path, capsys, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("MOELAB_CACHE", str(cache))
    for i, (source, message) in enumerate(_bad_inputs(tmp_path)):
        out = tmp_path / f"run{i}"
        code = main(["train", "tiny", "--data", source, "--out", str(out), "--steps", "2", "--quiet"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2, (source, err)
        assert len(err) == 1 and err[0] == f"moelab: {err[0][len('moelab: ') :]}" and message in err[0], (message, err)
        assert not (out / "config.json").exists()
        leftovers = list(cache.glob("*")) if cache.exists() else []
        assert not any((p / "manifest.json").exists() for p in leftovers), leftovers
        assert not any(p.name.startswith(".tmp") for p in leftovers), leftovers


def test_bad_data_exit_code_from_the_command_line(tmp_path):
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "moelab",
            "train",
            "tiny",
            "--data",
            str(tmp_path / "nope"),
            "--out",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert res.returncode == 2 and res.stderr.strip() == f"moelab: {tmp_path / 'nope'}: no such file or directory"


def test_mixture_proportions_and_phase_change(corpus):
    cfg = data_cfg(
        corpus,
        "data.mixture=[{code: 0.8, prose: 0.2}, {code: 0.3, prose: 0.7}]",
        "data.phase_starts=[0.0, 0.75]",
        "train.steps=400",
        "train.batch_size=8",
        "data.epoch_cap=1000",
    )
    store = build_store(cfg.data, 512, progress=False)
    mix = build_mixture(cfg, store)
    assert mix.phase_steps == (0, 300)
    assert [mix.phase_at(s) for s in (0, 299, 300, 399)] == [0, 0, 1, 1]
    code = mix.domains.index("code")
    for phase, (lo, hi), want in ((0, (0, 300), 0.8), (1, (300, 400), 0.3)):
        rows = np.concatenate([batch_at(store, mix, 7, s, 8, cfg.model.seq_len)[1] for s in range(lo, hi)])
        share = float(np.mean(rows == code))
        sigma = np.sqrt(want * (1 - want) / len(rows))
        assert abs(share - want) < 4 * sigma, (phase, share, want)


def test_processes_build_their_own_rows_of_the_same_batch(corpus):
    """Two processes, each building its half (rows 0-3 and 4-7), give the whole batch exactly."""
    cfg = data_cfg(corpus)
    store = build_store(cfg.data, 512, progress=False)
    mix = build_mixture(cfg, store)
    whole, domains = batch_at(store, mix, 3, 17, 8, 64)
    first, d0 = batch_rows(store, mix, 3, 17, 8, 64, 0, 4)
    second, d1 = batch_rows(store, mix, 3, 17, 8, 64, 4, 8)
    assert first.shape == second.shape == (4, 65)
    np.testing.assert_array_equal(np.concatenate([first, second]), whole)
    np.testing.assert_array_equal(d0, domains)
    np.testing.assert_array_equal(batch_rows(store, mix, 3, 17, 8, 64, 3, 6)[0], whole[3:6])


def test_batches_are_a_pure_function_of_seed_and_step(corpus):
    cfg = data_cfg(corpus)
    store = build_store(cfg.data, 512, progress=False)
    mix = build_mixture(cfg, store)
    a = batch_at(store, mix, 3, 17, 4, 64)[0]
    assert np.array_equal(a, batch_at(store, mix, 3, 17, 4, 64)[0])
    assert not np.array_equal(a, batch_at(store, mix, 4, 17, 4, 64)[0])
    overrides = [f"data.sources=[{corpus['code']}, {corpus['prose']}]", "model.vocab_size=512"]
    code = (
        "import hashlib, sys; from moelab.config import load_config; from moelab.data.store import build_store;"
        "from moelab.data.mixture import build_mixture, batch_at;"
        f"cfg = load_config('tiny', {overrides!r});"
        "st = build_store(cfg.data, 512, progress=False); mx = build_mixture(cfg, st);"
        "print(hashlib.sha256(b''.join(batch_at(st, mx, 3, s, 4, 64)[0].tobytes() for s in range(20))).hexdigest())"
    )
    digests = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        for _ in range(2)
    }
    import hashlib

    here = hashlib.sha256(b"".join(batch_at(store, mix, 3, s, 4, 64)[0].tobytes() for s in range(20))).hexdigest()
    assert digests == {here + "\n"}


def test_epoch_cap_refuses_or_warns(corpus):
    cfg = data_cfg(corpus, "data.mixture=[{code: 0.01, prose: 0.99}]", "train.steps=2000", "data.epoch_cap=2")
    store = build_store(cfg.data, 512, progress=False)
    with pytest.raises(S.DataError, match=r"data.epoch_cap: .* domain 'prose'"):
        build_mixture(cfg, store)
    with pytest.warns(UserWarning, match="data.epoch_cap"):
        mix = build_mixture(replace(cfg, data={"epoch_cap_action": "warn"}), store)
    assert mix.epochs["prose"] > 2


def test_unknown_domain_in_mixture_is_named(corpus):
    cfg = data_cfg(corpus, "data.mixture=[{code: 1, poetry: 1}]")
    store = build_store(cfg.data, 512, progress=False)
    with pytest.raises(S.DataError, match=r"data.mixture\[0\].poetry: unknown domain"):
        build_mixture(cfg, store)


def test_a_failure_while_tokenizing_leaves_no_store(corpus, tmp_path, monkeypatch):
    cfg = data_cfg(corpus, "data.workers=1")  # tokenized in this process, where the failure is planted

    def broken(*args):
        raise RuntimeError("disk full")

    monkeypatch.setattr(T, "encode", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        build_store(cfg.data, 512, cache=tmp_path / "cache", progress=False)
    # neither a complete store nor a temporary one; the build's folder stays, for the next build to resume
    assert not list((tmp_path / "cache").glob("store-*")) and not list((tmp_path / "cache").glob(".tmp-*"))
    monkeypatch.undo()
    assert build_store(cfg.data, 512, cache=tmp_path / "cache", progress=False).domains == ["code", "prose"]
    assert not list((tmp_path / "cache").glob(".build-*"))


def test_more_bad_inputs_are_one_line_errors(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"text": "a"}\n' + "[" * 200000 + "\n")
    surrogate = tmp_path / "surrogate.jsonl"
    surrogate.write_text('{"text": "a"}\n{"text": "\\ud800"}\n')
    for path, message in ((deep, f"{deep}:2: not valid JSON"), (surrogate, f"{surrogate}:2: field 'text' holds")):
        with pytest.raises(S.DataError) as info:
            list(S.iter_documents(S.resolve([str(path)])[0]))
        assert message in str(info.value)
    table = pa.table({"text": pa.array(["x", "y", "x"]).dictionary_encode()})
    pq.write_table(table, tmp_path / "dict.parquet")
    assert [d.text for d in S.iter_documents(S.resolve([str(tmp_path / "dict.parquet")])[0])] == ["x", "y", "x"]


def test_cheaders_is_three_domains_of_the_compilers_headers(tmp_path, monkeypatch):
    root = tmp_path / "include"
    files = {
        "stdio.h": "int printf(const char *, ...);\n",
        "x86_64-linux-gnu/bits/types.h": "typedef int __int32_t;\n",
        "x86_64-linux-gnu/python3.11/pyconfig.h": "#define HAVE_PY 1\n",  # Python's: left out
        "x86_64-linux-gnu/c++/12/bits/c++config.h": "#define CXX 1\n",  # C++'s multiarch config: left out
        "linux/types.h": "typedef unsigned int __u32;\n",
        "asm-generic/int-ll64.h": "typedef long long __s64;\n",
        "c++/11/vector": "// old\n",
        "c++/12/vector": "namespace std { template<class T> class vector; }\n",  # no suffix, the newest version
        "c++/12/bits/stl_vector.h": "// vector\n",
        "openssl/ssl.h": "// another library's own directory: left out\n",
        "latin1.h": b"/* caf\xe9 */\n",  # not UTF-8: left out, as the standard library's are
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(text if isinstance(text, bytes) else text.encode())
    monkeypatch.setattr(S, "cheaders_root", lambda: root)
    domains = S.resolve(["cheaders"])
    assert tuple(d.name for d in domains) == S.CHEADERS_DOMAINS
    docs = {(d.domain, d.doc_id) for dom in domains for d in S.iter_documents(dom)}
    assert docs == {
        ("cheaders-libc", "stdio.h"),
        ("cheaders-libc", "x86_64-linux-gnu/bits/types.h"),
        ("cheaders-linux", "linux/types.h"),
        ("cheaders-linux", "asm-generic/int-ll64.h"),
        ("cheaders-cxx", "c++/12/vector"),
        ("cheaders-cxx", "c++/12/bits/stl_vector.h"),
    }
    monkeypatch.setattr(S, "cheaders_root", lambda: tmp_path / "nowhere")
    with pytest.raises(S.DataError, match="no C headers under .*libc6-dev"):
        S.resolve(["cheaders"])


def test_cheaders_on_this_machine_is_not_python():
    root = S.cheaders_root()
    if not S.cheaders_files(root):
        pytest.skip(f"no C headers under {root} on this machine")
    by_domain = {}
    for domain, path in S.cheaders_files(root):
        by_domain.setdefault(domain, []).append(path)
        assert path.suffix != ".py" and "python" not in str(path.relative_to(root)).lower()
    assert set(by_domain) == set(S.CHEADERS_DOMAINS)


def _decoded(store, domain: str, split: str) -> str:
    tok = store.tokenizer()
    ids = [int(i) for i in store.stream(domain, split) if int(i) != store.eot]
    return tok.decode(ids)


def test_one_document_is_cut_by_position_so_part_of_it_is_held_out(corpus, tmp_path):
    """A corpus that is one document (a book, a dump): hashing cannot hold part of it out, so the
    domain is cut by position: its last ceil(f x tokens) tokens are held out; the two sides together
    give back the whole text."""
    text = Path(corpus["code"], "textwrap.py").read_text() * 3
    book = tmp_path / "book.jsonl"
    book.write_text(json.dumps({"text": text}) + "\n")
    cfg = load_config("tiny", [f"data.sources=[{book}]", "model.vocab_size=512", "data.held_out_fraction=0.05"])
    store = build_store(cfg.data, 512, cache=tmp_path / "cache", progress=False)
    train, held = store.stream("book", "train"), store.stream("book", "heldout")
    assert store.manifest["stats"]["book"]["split"] == "position"
    assert len(held) == int(np.ceil(0.05 * (len(train) + len(held))))
    tok = store.tokenizer()
    joined = np.concatenate([train, held])
    assert joined[-1] == store.eot and tok.decode(joined[:-1].tolist()) == text  # nothing lost or doubled, in order
    tiny = tmp_path / "tiny.jsonl"
    tiny.write_text(json.dumps({"text": "too short to split"}) + "\n")
    small = load_config("tiny", [f"data.sources=[{tiny}]"])
    store = build_store(small.data, 512, cache=tmp_path / "c2", progress=False)
    with pytest.raises(S.DataError, match=r"tiny: only \d+ training tokens, fewer than model.seq_len"):
        build_mixture(small, store)


def test_a_long_document_is_cut_into_pieces_at_line_ends(corpus, tmp_path, monkeypatch):
    long = Path(corpus["code"], "textwrap.py").read_text()
    pieces = list(S.pieces(S.Document("d", "x", long), 4000))
    assert len(pieces) >= len(long) // 4000 and "".join(p.text for p in pieces) == long
    assert all(len(p.text) <= 4000 for p in pieces) and all(p.text.endswith("\n") for p in pieces[:-1])
    assert [p.doc_id for p in pieces[:2]] == ["x#0", "x#1"]
    monkeypatch.setattr(S, "MAX_PIECE_CHARS", 4000)
    cfg = data_cfg(corpus, "data.workers=1")  # in this process, where the smaller pieces are set
    store = build_store(cfg.data, 512, cache=tmp_path / "cache", progress=False)
    files = sum(len(u["files"]) for u in store.manifest["units"])
    docs = store.documents()
    assert len(docs) > files and docs["tokens"].max() < 4000  # the longer library files were cut


def test_an_interrupted_build_is_cleaned_up_by_the_next(corpus, tmp_path):
    import subprocess as sp

    cache = tmp_path / "cache"
    cache.mkdir()
    dead = sp.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = cache / f".tmp-store-abc-{dead.pid}"
    (stale / "x").mkdir(parents=True)
    live = cache / f".tmp-store-abc-{os.getpid()}"  # an assembly still running (this process)
    live.mkdir()
    build_store(data_cfg(corpus).data, 512, cache=cache, progress=False)
    assert not stale.exists() and live.exists()


def test_a_directory_source_reads_every_text_file_by_content_and_takes_globs(tmp_path):
    """Perl, Rust, Go and files without a suffix are text; a binary and a Latin-1 file are left out
    (and named); hidden paths are skipped; data.include and data.exclude choose files."""
    code = tmp_path / "polyglot"
    (code / "src").mkdir(parents=True)
    (code / ".git").mkdir()
    files = {"a.pl": "print 'hi';\n", "src/b.rs": "fn main() {}\n", "src/c.go": "package main\n", "Makefile": "all:\n"}
    for name, text in files.items():
        (code / name).write_text(text)
    (code / ".git" / "config").write_text("[core]\n")
    (code / "blob.bin").write_bytes(b"\x7fELF\0\0\0\x01 valid UTF-8, but binary")
    (code / "old.txt").write_bytes("caf\xe9".encode("latin-1"))
    (dom,) = S.resolve([str(code)])
    skipped: list = []
    docs = {d.doc_id: d.text for d in S.iter_documents(dom, left_out=skipped)}
    assert docs == {
        "Makefile": "all:\n",
        "a.pl": "print 'hi';\n",
        "src/b.rs": "fn main() {}\n",
        "src/c.go": "package main\n",
    }
    assert sorted(skipped) == ["blob.bin", "old.txt"]
    (dom,) = S.resolve([str(code)], include=("*.rs", "*.go"), exclude=("src/c.*",))
    assert [d.doc_id for d in S.iter_documents(dom)] == ["src/b.rs"]
    with pytest.raises(S.DataError, match=r"no files to read among 0 files include \['\*.java'\]"):
        S.resolve([str(code)], include=("*.java",))
    cfg = load_config("tiny", [f"data.sources=[{code}]", "data.include=['*.rs', '*.go']"])
    assert cfg.data.include == ("*.rs", "*.go")
    with pytest.raises(Exception, match=r"data.exclude: a list of file globs"):
        load_config("tiny", ["data.exclude=['']"])


def test_a_large_file_is_read_as_a_stream_into_the_same_pieces(tmp_path, monkeypatch):
    """Past STREAM_BYTES a file is never held whole: decoded in chunks and cut as it comes, into
    exactly the pieces the store cuts a document into (non-ASCII text, long and short lines)."""
    line = "naïve λ 🙂 " * 7 + "\n"
    text = "".join(line * (i % 5 + 1) + ("x" * 5000 if i % 7 == 0 else "") for i in range(300))
    root = tmp_path / "big"
    root.mkdir()
    (root / "big.txt").write_text(text, encoding="utf-8")
    (root / "small.txt").write_text("short\n")
    expect = [(p.doc_id, p.text) for p in S.pieces(S.Document("big", "big.txt", text), 3000)]
    monkeypatch.setattr(R, "STREAM_BYTES", 10_000)  # the text reader's own
    monkeypatch.setattr(R, "MAX_PIECE_CHARS", 3000)
    got = [(d.doc_id, d.text) for d in S.iter_documents(S.resolve([str(root)])[0]) if d.doc_id != "small.txt"]
    assert got == expect and len(got) > 10
    (root / "big.txt").write_bytes(text.encode("utf-8") + b"\xff tail")  # not UTF-8 near its end
    skipped: list = []
    assert [d.doc_id for d in S.iter_documents(S.resolve([str(root)])[0], left_out=skipped)] == ["small.txt"]
    assert skipped == ["big.txt"]


def test_text_field_by_domain_names_training_and_validation_domains(tmp_path):
    """data.text_field as a mapping may name a validation domain beside training ones; a name that is
    neither is one line naming the field, both lists of domains known."""
    from moelab.config import DataConfig
    from moelab.data import sources as S
    from moelab.data.store import resolve_all

    (tmp_path / "train.jsonl").write_text(json.dumps({"body": "def f(): pass"}) + "\n")
    (tmp_path / "val.jsonl").write_text(json.dumps({"notes": "held apart"}) + "\n")
    cfg = DataConfig(
        sources={"code": (str(tmp_path / "train.jsonl"),)},
        validation={"valdata": (str(tmp_path / "val.jsonl"),)},
        text_field={"code": "body", "valdata": "notes"},
    )
    domains, vdomains = resolve_all(cfg)
    assert [(d.name, d.text_field) for d in domains + vdomains] == [("code", "body"), ("valdata", "notes")]
    bad = DataConfig(sources=cfg.sources, validation=cfg.validation, text_field={"code": "body", "prose": "x"})
    with pytest.raises(S.DataError, match=r"data.text_field.prose: unknown domain \(known: code, valdata\)"):
        resolve_all(bad)


@pytest.mark.slow  # 11 s: three runs (make test under 15 minutes; CI's make test-all runs it)
def test_the_data_seed_moves_the_batches_and_leaves_the_initialisation(corpus, tmp_path):
    """train.data_seed (issue 37): a run's data order apart from its parameters' seed."""
    from conftest import MICRO
    from moelab.config import config_hash, load_config
    from moelab.errors import ConfigError
    from moelab.train.loop import train

    base = [*MICRO, f"data.sources=[{corpus['code']}, {corpus['prose']}]", "train.steps=3", "train.eval_every=3"]
    runs = {}
    for name, extra in (("seed0", []), ("data0", ["train.data_seed=0"]), ("data7", ["train.data_seed=7"]),
                        ("seed7", ["train.seed=7"])):  # fmt: skip
        cfg = load_config("tiny", base + extra)
        train(cfg, tmp_path / name, progress=False)
        recs = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        runs[name] = ([r["loss"] for r in recs if r.get("kind") == "train"],
                      [r["loss"]["mix"] for r in recs if r.get("kind") == "eval" and r["step"] == 0][0], cfg)  # fmt: skip
    assert config_hash(load_config("tiny", base)) == config_hash(load_config("tiny", [*base, "train.data_seed=-1"]))
    assert runs["data0"][:2] == runs["seed0"][:2]  # data_seed = train.seed reads what the default reads
    assert runs["data7"][1] == runs["seed0"][1]  # the same initial model: the same held-out loss at step 0
    assert runs["data7"][0] != runs["seed0"][0]  # other batches, other training losses
    assert runs["seed7"][1] != runs["seed0"][1]  # train.seed still moves the initialisation
    with pytest.raises(ConfigError, match="train.data_seed"):
        load_config("tiny", ["train.data_seed=-2"])


def test_a_zstd_file_cut_inside_a_later_frame_is_one_line(tmp_path):
    """A multi-frame .zst cut inside its second frame is refused in one line naming the file (zstandard's
    own stream reader would end there quietly, a truncated shard read as a shorter one)."""
    import zstandard

    z = zstandard.ZstdCompressor()
    lines = [json.dumps({"text": f"document {i} " * 40}).encode() + b"\n" for i in range(200)]
    whole = z.compress(b"".join(lines[:100])) + z.compress(b"".join(lines[100:]))
    path = tmp_path / "two.jsonl.zst"
    path.write_bytes(whole)
    assert len(list(S.iter_documents(S.resolve([str(path)])[0]))) == 200
    path.write_bytes(whole[:-50])
    with pytest.raises(
        S.DataError, match=r"two.jsonl.zst: cannot be read \(EOFError: the zstd stream ends inside a frame\)"
    ):
        list(S.iter_documents(S.resolve([str(path)])[0]))
