"""Real corpora: shards of every format and compression, globs, parallel and resumable builds,
bad shards, validation sets (issue 26)."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from conftest import ROOT
from moelab.cli import main
from moelab.config import load_config
from moelab.data import sources as S
from moelab.data import store as store_mod
from moelab.data.store import build_store

VOCAB = 384


def _docs(n: int = 60, seed: int = 0) -> list[str]:
    """Documents of varied length, non-ASCII included, one empty (left out everywhere)."""
    rng = np.random.default_rng(seed)
    words = "def class return naïve café λ 🙂 import numpy as np while for if else lambda yield".split()
    out = [" ".join(rng.choice(words, size=int(rng.integers(3, 120)))) + "\n" for _ in range(n)]
    if n > 7:
        out[7] = ""
    return out


def _jsonl_bytes(texts, field="text") -> bytes:
    return "".join(
        json.dumps({field: t, "url": f"https://example.org/{i}"}) + "\n" for i, t in enumerate(texts)
    ).encode()


def _write_all_formats(root: Path, texts: list[str]) -> dict[str, Path]:
    """The same documents in every format and compression the store reads."""
    root.mkdir(parents=True, exist_ok=True)
    raw = _jsonl_bytes(texts)
    out = {}
    out["jsonl"] = root / "a.jsonl"
    out["jsonl"].write_bytes(raw)
    out["jsonl.gz"] = root / "a.jsonl.gz"
    out["jsonl.gz"].write_bytes(gzip.compress(raw))
    out["json.gz"] = root / "a.json.gz"  # Dolma's name for JSON lines
    out["json.gz"].write_bytes(gzip.compress(raw))
    out["jsonl.zst"] = root / "a.jsonl.zst"
    out["jsonl.zst"].write_bytes(zstandard.ZstdCompressor().compress(raw))
    out["jsonl.bz2"] = root / "a.jsonl.bz2"
    out["jsonl.bz2"].write_bytes(bz2.compress(raw))
    out["jsonl.xz"] = root / "a.jsonl.xz"
    out["jsonl.xz"].write_bytes(lzma.compress(raw))
    table = pa.table({"id": list(range(len(texts))), "text": texts})
    out["parquet"] = root / "a.parquet"
    pq.write_table(table, out["parquet"], row_group_size=7)  # several row groups
    out["parquet.zst"] = root / "b.parquet.zst"
    out["parquet.zst"].write_bytes(zstandard.ZstdCompressor().compress(out["parquet"].read_bytes()))
    out["arrow"] = root / "a.arrow"  # the IPC file format
    with pa.ipc.new_file(out["arrow"], table.schema) as w:
        for b in table.to_batches(max_chunksize=9):
            w.write_batch(b)
    ds = root / "saved"  # a datasets save_to_disk folder: the IPC stream format and two JSON files
    ds.mkdir()
    with pa.ipc.new_stream(ds / "data-00000-of-00001.arrow", table.schema) as w:
        for b in table.to_batches(max_chunksize=11):
            w.write_batch(b)
    (ds / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (ds / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string"}}}))
    out["save_to_disk"] = ds
    return out


@pytest.fixture(scope="module")
def tokfile(tmp_path_factory):
    """One tokenizer for every store of this module, so that stores can be compared byte for byte."""
    from moelab.data import tokenizer as T

    folder = tmp_path_factory.mktemp("tok")
    tok = T.train(_docs(200, seed=1), VOCAB)
    tok.tokenizer.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def _cfg(sources, tokfile, *more):
    return load_config(
        "tiny",
        [f"data.sources={json.dumps(sources)}", f"data.tokenizer={tokfile}", f"model.vocab_size={VOCAB}", *more],
    ).data


def _bytes(store, name="tokens.bin") -> bytes:
    return (store.path / name).read_bytes()


def test_every_format_and_compression_gives_the_same_tokens(tmp_path, tokfile):
    texts = _docs()
    files = _write_all_formats(tmp_path / "shards", texts)
    ref = build_store(_cfg({"d": [str(files["jsonl"])]}, tokfile, "data.held_out_fraction=0"), VOCAB,
                      cache=tmp_path / "cache", progress=False)  # fmt: skip
    tok = ref.tokenizer()
    expect = [tok.encode(t).ids + [ref.eot] for t in texts if t.strip()]
    assert ref.tokens.tolist() == [i for ids in expect for i in ids]  # independent: per-document encode
    assert ref.manifest["stats"]["d"]["train"]["documents"] == len(texts) - 1
    for fmt, path in files.items():
        got = build_store(_cfg({"d": [str(path)]}, tokfile, "data.held_out_fraction=0"), VOCAB,
                          cache=tmp_path / "cache", progress=False)  # fmt: skip
        assert (got.path == ref.path) == (fmt == "jsonl")
        assert _bytes(got) == _bytes(ref), fmt
        docs, rdocs = got.documents(), ref.documents()
        assert np.array_equal(docs["tokens"], rdocs["tokens"]) and np.array_equal(docs["bytes"], rdocs["bytes"]), fmt
    assert sum(ref.documents()["bytes"]) == sum(len(t.encode()) for t in texts)


def test_a_folder_is_read_as_what_it_holds(tmp_path, tokfile):
    texts = _docs(30)
    mixed = tmp_path / "mixed"
    files = _write_all_formats(tmp_path / "all", texts)
    mixed.mkdir()
    for fmt in ("jsonl.zst", "parquet", "json.gz"):
        os.link(files[fmt], mixed / files[fmt].name)
    (mixed / "README.md").write_text("# about these shards\n")  # beside records: left out, never trained on
    (domain,) = S.resolve([str(mixed)])
    assert [(s.rel, s.fmt, s.codec) for s in domain.shards] == [
        ("a.json.gz", "jsonl", "gz"), ("a.jsonl.zst", "jsonl", "zst"), ("a.parquet", "parquet", "")]  # fmt: skip
    assert domain.left_out == ("README.md",)
    store = build_store(
        _cfg([str(mixed)], tokfile, "data.held_out_fraction=0"), VOCAB, cache=tmp_path / "c", progress=False
    )
    assert store.manifest["stats"]["mixed"]["train"]["documents"] == 3 * (len(texts) - 1)
    text = store.tokenizer().decode([int(i) for i in store.tokens if int(i) != store.eot])
    assert "https://example.org" not in text and "about these shards" not in text  # records' text only
    # a folder of .json files holding JSON lines (a byte-order mark on one) is records too
    plain = tmp_path / "plainjson"
    plain.mkdir()
    (plain / "a.json").write_bytes(_jsonl_bytes(texts[:5]))
    (plain / "b.json").write_bytes(b"\xef\xbb\xbf" + _jsonl_bytes(texts[5:9]))
    (pj,) = S.resolve([str(plain)])
    assert [s.fmt for s in pj.shards] == ["jsonl", "jsonl"] and [d.text for d in S.iter_documents(pj)] == texts[:9]
    code = tmp_path / "jsproject"  # ... but a package.json beside code is text, like the code
    code.mkdir()
    (code / "package.json").write_text('{\n  "name": "x"\n}\n')
    (code / "index.js").write_text("console.log(1);\n")
    (js,) = S.resolve([str(code)])
    assert [(s.rel, s.fmt) for s in js.shards] == [("index.js", "text"), ("package.json", "text")]
    # a datasets save_to_disk folder is its Arrow data, never its JSON metadata
    (ds,) = S.resolve([str(files["save_to_disk"])])
    assert [s.fmt for s in ds.shards] == ["arrow"]
    docs = [d.text for d in S.iter_documents(ds)]
    assert docs == texts and not any("_data_files" in d for d in docs)


def test_globs_across_folders_with_equal_file_names(tmp_path, tokfile):
    for dump, seed in (("CC-2023", 0), ("CC-2024", 1)):
        (tmp_path / "fw" / dump).mkdir(parents=True)
        pq.write_table(pa.table({"text": _docs(10, seed)}), tmp_path / "fw" / dump / "000_00000.parquet")
    cfg = _cfg({"web": [str(tmp_path / "fw" / "**" / "*.parquet")]}, tokfile)
    (web,) = S.resolve(cfg.sources)
    assert [s.rel for s in web.shards] == ["CC-2023/000_00000.parquet", "CC-2024/000_00000.parquet"]
    store = build_store(cfg, VOCAB, cache=tmp_path / "c", progress=False)
    assert store.domains == ["web"]
    st = store.manifest["stats"]["web"]
    assert st["train"]["documents"] + st["heldout"]["documents"] == 18
    # list form: one name for several entries makes one domain; the same file names stay apart
    both = S.resolve([f"web={tmp_path / 'fw' / 'CC-2023'}", f"web={tmp_path / 'fw' / 'CC-2024'}"])
    assert len(both) == 1 and [s.rel for s in both[0].shards] == ["0:000_00000.parquet", "1:000_00000.parquet"]
    with pytest.raises(S.DataError, match="matches no files"):
        S.resolve({"web": [str(tmp_path / "fw" / "**" / "*.jsonl")]})


def test_workers_and_resume_give_the_same_bytes(tmp_path, tokfile, monkeypatch):
    monkeypatch.setattr(store_mod, "UNIT_BYTES", 4000)  # many units from a small corpus
    root = tmp_path / "shards"
    root.mkdir()
    for i in range(8):
        (root / f"s{i}.jsonl.gz").write_bytes(gzip.compress(_jsonl_bytes(_docs(40, seed=i))))
    cfg = _cfg([str(root)], tokfile, "data.held_out_fraction=0.1")
    one = build_store(cfg, VOCAB, cache=tmp_path / "one", progress=False)
    assert len(one.manifest["units"]) >= 4
    three = build_store(
        _cfg([str(root)], tokfile, "data.held_out_fraction=0.1", "data.workers=3"),
        VOCAB,
        cache=tmp_path / "three",
        progress=False,
    )
    for name in ("tokens.bin", "documents.bin", "manifest.json", "tokenizer.json"):
        assert _bytes(three, name) == _bytes(one, name), name
    monkeypatch.setattr(store_mod, "ASSEMBLE_DOCS", 7)  # the assembly's chunks cut units and held-out runs
    chunked = build_store(cfg, VOCAB, cache=tmp_path / "chunked", progress=False)
    for name in ("tokens.bin", "documents.bin", "manifest.json"):
        assert _bytes(chunked, name) == _bytes(one, name), name
    monkeypatch.undo()
    monkeypatch.setattr(store_mod, "UNIT_BYTES", 4000)
    # killed (SIGKILL) after two units: the next build resumes from them and gives the same bytes
    script = f"""
import os, signal, sys
sys.path.insert(0, {str(ROOT / "tests")!r})
from moelab.config import load_config
from moelab.data import store as m
m.UNIT_BYTES = 4000
real, calls = m.encode_unit, []
def dying(job):
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    calls.append(1)
    return real(job)
m.encode_unit = dying
cfg = load_config("tiny", [{f"data.sources=[{root}]"!r}, {f"data.tokenizer={tokfile}"!r}, "model.vocab_size={VOCAB}",
                           "data.held_out_fraction=0.1", "data.workers=1"]).data
m.build_store(cfg, {VOCAB}, cache={str(tmp_path / "killed")!r}, progress=False)
"""
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == -9, res.stderr
    (build,) = (tmp_path / "killed").glob(".build-store-*[!k]")
    assert len(list((build / "units").glob("*.json"))) == 2
    assert not list((tmp_path / "killed").glob("store-*"))  # nothing that looks complete
    calls = []
    real = store_mod.encode_unit
    monkeypatch.setattr(store_mod, "encode_unit", lambda job: calls.append(job["unit"].index) or real(job))
    resumed = build_store(_cfg([str(root)], tokfile, "data.held_out_fraction=0.1", "data.workers=1"), VOCAB,
                          cache=tmp_path / "killed", progress=False)  # fmt: skip
    assert len(calls) == len(one.manifest["units"]) - 2 and 0 not in calls and 1 not in calls
    for name in ("tokens.bin", "documents.bin", "manifest.json"):
        assert _bytes(resumed, name) == _bytes(one, name), name
    assert not list((tmp_path / "killed").glob(".build-*"))


@pytest.mark.slow
def test_a_ray_build_gives_the_same_bytes(tmp_path, tokfile, monkeypatch):
    pytest.importorskip("ray")
    monkeypatch.setattr(store_mod, "UNIT_BYTES", 4000)
    root = tmp_path / "shards"
    root.mkdir()
    for i in range(4):
        (root / f"s{i}.jsonl").write_bytes(_jsonl_bytes(_docs(40, seed=i)))
    local = build_store(_cfg([str(root)], tokfile), VOCAB, cache=tmp_path / "local", progress=False)
    ray = build_store(_cfg([str(root)], tokfile, "data.backend=ray"), VOCAB, cache=tmp_path / "ray", progress=False)
    for name in ("tokens.bin", "documents.bin", "manifest.json"):
        assert _bytes(ray, name) == _bytes(local, name), name


def _bad_shards(tmp_path: Path) -> list[tuple[Path, str]]:
    raw = _jsonl_bytes(_docs(200))
    cut_gz = tmp_path / "cut.jsonl.gz"
    cut_gz.write_bytes(gzip.compress(raw)[:-300])
    cut_zst = tmp_path / "cut.jsonl.zst"
    cut_zst.write_bytes(zstandard.ZstdCompressor().compress(raw)[:-300])
    nofield = tmp_path / "nofield.parquet"
    pq.write_table(pa.table({"content": _docs(5)}), nofield)
    notjson = tmp_path / "notjson.jsonl"
    notjson.write_bytes(_jsonl_bytes(_docs(3)) + b"{oops\n" + _jsonl_bytes(_docs(2)))
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(_jsonl_bytes(["ok"]) + b'{"text": "caf\xe9"}\n')
    latin_txt = tmp_path / "latin.txt"
    latin_txt.write_bytes("plain text, then caf\xe9\n".encode("latin-1"))
    return [
        (cut_gz, f"{cut_gz}: cannot be read"),
        (cut_zst, f"{cut_zst}: cannot be read"),
        (nofield, f"{nofield}: no column 'text'"),
        (notjson, f"{notjson}:4: not valid JSON"),
        (latin, f"{latin}:2: not UTF-8 text"),
        (latin_txt, f"{latin_txt}: not UTF-8 text"),
    ]


def test_bad_shards_are_one_line_exit_2_and_nothing_written(tmp_path, capsys, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("MOELAB_CACHE", str(cache))
    good = tmp_path / "good.jsonl"
    good.write_bytes(_jsonl_bytes(_docs(20)))
    for i, (path, message) in enumerate(_bad_shards(tmp_path)):
        out = tmp_path / f"run{i}"
        code = main(["train", "tiny", "--data", f"web={good}", "--data", f"web={path}", "--out", str(out),
                     "--steps", "2", "--quiet"])  # fmt: skip
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and message in err[0], (message, err)
        assert not out.exists() or not any(out.iterdir())
        assert not list(cache.glob("store-*")) and not list(cache.glob(".build-*")) and not list(cache.glob(".tmp-*"))


def test_skip_leaves_bad_records_out_and_counts_them(tmp_path, tokfile):
    bad = dict((p.name, p) for p, _ in _bad_shards(tmp_path))
    good = tmp_path / "good.jsonl"
    good.write_bytes(_jsonl_bytes(_docs(20)))
    names = ["notjson.jsonl", "latin.jsonl", "nofield.parquet", "cut.jsonl.gz"]
    cfg = _cfg({"web": [str(good)] + [str(bad[n]) for n in names]}, tokfile, "data.bad_records=skip")
    store = build_store(cfg, VOCAB, cache=tmp_path / "c", progress=False)
    left = store.manifest["bad_records"]["web"]
    assert left["notjson.jsonl"]["records"] == 1 and "notjson.jsonl:4: not valid JSON" in left["notjson.jsonl"]["why"]
    assert left["latin.jsonl"]["records"] == 1
    assert left["nofield.parquet"]["records"] == 5
    assert "cut.jsonl.gz" in left and "cannot be read" in left["cut.jsonl.gz"]["why"]
    st = store.manifest["stats"]["web"]
    n = st["train"]["documents"] + st["heldout"]["documents"]
    assert n >= 19 + 5 + 1  # the good file, the good lines of the others, and what the cut file gave before its end


def test_an_empty_source_is_refused(tmp_path, capsys):
    for args in (["--data", ""], ["--set", "data.sources=['']"], ["--set", "data.sources={web: []}"]):
        code = main(["train", "tiny", *args, "--out", str(tmp_path / "run"), "--steps", "1", "--quiet"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and "data.sources" in err[0], err
        assert not (tmp_path / "run").exists()


def test_held_out_fraction_is_honoured(tmp_path, tokfile):
    few = tmp_path / "few.jsonl"
    few.write_bytes(_jsonl_bytes(_docs(10)[:7] + _docs(10)[8:]))  # 9 documents
    none = build_store(
        _cfg([str(few)], tokfile, "data.held_out_fraction=0"), VOCAB, cache=tmp_path / "c", progress=False
    )
    assert len(none.stream("few", "heldout")) == 0 and none.manifest["stats"]["few"]["split"] == "hash"
    # 9 documents at 2%: hashing holds out none of them, so the domain is cut by position at 2% of its tokens
    two = build_store(
        _cfg([str(few)], tokfile, "data.held_out_fraction=0.02"), VOCAB, cache=tmp_path / "c", progress=False
    )
    total = len(two.stream("few", "train")) + len(two.stream("few", "heldout"))
    assert two.manifest["stats"]["few"]["split"] == "position"
    assert len(two.stream("few", "heldout")) == int(np.ceil(0.02 * total))
    assert np.array_equal(
        np.concatenate([two.stream("few", "train"), two.stream("few", "heldout")]), none.stream("few", "train")
    )
    # many documents: about the fraction, by hash
    many = tmp_path / "many.jsonl"
    many.write_bytes(_jsonl_bytes([f"document {i}\n" for i in range(3000)]))
    st = build_store(_cfg([str(many)], tokfile, "data.held_out_fraction=0.1"), VOCAB, cache=tmp_path / "c",
                     progress=False).manifest["stats"]["many"]  # fmt: skip
    assert st["split"] == "hash" and abs(st["heldout"]["documents"] - 300) < 4 * np.sqrt(3000 * 0.1 * 0.9)


def test_memory_filesystem_through_fsspec(tmp_path, tokfile):
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    texts = _docs(25)
    fs.pipe("memory://bucket/web/part-0.jsonl.zst", zstandard.ZstdCompressor().compress(_jsonl_bytes(texts)))
    with fs.open("memory://bucket/web/sub/part-1.parquet", "wb") as fh:
        pq.write_table(pa.table({"text": texts}), fh)
    cfg = _cfg({"web": ["memory://bucket/web/**"]}, tokfile, "data.held_out_fraction=0")
    (web,) = S.resolve(cfg.sources)
    assert [(s.rel, s.fmt) for s in web.shards] == [("part-0.jsonl.zst", "jsonl"), ("sub/part-1.parquet", "parquet")]
    store = build_store(cfg, VOCAB, cache=tmp_path / "c", progress=False)
    assert store.manifest["stats"]["web"]["train"]["documents"] == 2 * (len(texts) - 1)


def test_token_ids_are_read_as_documents(tmp_path, tokfile):
    from moelab.data import tokenizer as T

    tok = T.load(str(tokfile), VOCAB)
    texts = [t for t in _docs(12) if t.strip()]
    ids = np.concatenate(
        [np.asarray(tok.tokenizer.encode(t, add_special_tokens=False).ids + [tok.eos], np.uint16) for t in texts]
    )
    np.save(tmp_path / "pre.npy", ids)
    ids.tofile(tmp_path / "pre.bin")
    (tmp_path / "text.jsonl").write_bytes(_jsonl_bytes(texts))
    ref = build_store(_cfg({"d": [str(tmp_path / "text.jsonl")]}, tokfile, "data.held_out_fraction=0"), VOCAB,
                      cache=tmp_path / "c", progress=False)  # fmt: skip
    for name in ("pre.npy", "pre.bin"):
        got = build_store(_cfg({"d": [str(tmp_path / name)]}, tokfile, "data.held_out_fraction=0"), VOCAB,
                          cache=tmp_path / "c", progress=False)  # fmt: skip
        assert _bytes(got) == _bytes(ref), name
        assert np.array_equal(got.documents()["bytes"], ref.documents()["bytes"])  # bytes per byte-level token
    no_tok = load_config("tiny", [f"data.sources=[{tmp_path / 'pre.npy'}]"]).data
    with pytest.raises(S.DataError, match=r"pre.npy: token ids are read with the tokenizer that made them"):
        build_store(no_tok, VOCAB, cache=tmp_path / "c", progress=False)


def test_a_pretrained_tokenizer_keeps_its_own_bos_and_eos(tmp_path):
    """A model folder with tokenizer.json and tokenizer_config.json (Llama-2's way: <s> first, </s>
    last): no <|endoftext|> added, each document [<s>] + ids + [</s>] in the store."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)  # fmt: skip
    tok.train_from_iterator(_docs(100), trainer)
    folder = tmp_path / "model"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}, "add_bos_token": True})
    )
    texts = [t for t in _docs(20) if t.strip()]
    (tmp_path / "d.jsonl").write_bytes(_jsonl_bytes(texts))
    cfg = load_config("tiny", [f"data.sources=[{tmp_path / 'd.jsonl'}]", f"data.tokenizer={folder}",
                               "data.held_out_fraction=0"]).data  # fmt: skip
    store = build_store(cfg, 512, cache=tmp_path / "c", progress=False)
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    assert store.manifest["vocab_size"] == tok.get_vocab_size() and store.tokenizer().token_to_id(store_mod.EOT) is None
    assert store.eot == eos and store.manifest["bos"] == bos
    expect = [[bos] + tok.encode(t).ids + [eos] for t in texts]
    assert store.tokens.tolist() == [i for ids in expect for i in ids]
    assert list(store.documents()["tokens"]) == [len(e) for e in expect]


def test_devices_past_the_simulation_limit_and_a_mismatched_mesh_are_refused_at_once(tmp_path):
    """`--devices 100000` used to hang while XLA made the devices; a count the mesh does not use is named."""
    for args, message in ((["--devices", "100000"], "--devices: 100000 simulated CPU devices is more than"),
                          (["--devices", "4"], "the config's mesh is mesh.data x mesh.expert = 1 x 1 = 1")):  # fmt: skip
        res = subprocess.run([sys.executable, "-m", "moelab", "train", "tiny", *args, "--out", str(tmp_path / "o")],
                             capture_output=True, text=True, cwd=ROOT, timeout=60)  # fmt: skip
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1 and message in lines[0], res.stderr
        assert not (tmp_path / "o").exists()
