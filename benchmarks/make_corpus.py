"""A synthetic corpus of many documents across mixed formats, for benchmarks/data_pipeline.py.

Offline and deterministic (a seed): each document is an excerpt of a local source file (the standard
library's ``*.py`` and the C headers under /usr/include), starting at a line and running to the end of
the line where its length is reached; the lengths are lognormal (median ``--median-bytes``, spread
``--sigma``: with the defaults the mean is about 480 bytes, so 5M documents make about 2.4 GB). The
documents go into one folder per format, each a domain of the token store:

- ``parquet/``: Parquet shards (snappy), a row group per ``--row-group`` documents;
- ``jsonl_zst/``: JSON lines, zstd-compressed (``.jsonl.zst``);
- ``json_gz/``: JSON lines named ``.json``, gzip-compressed (``.json.gz``);
- ``arrow/``: Arrow IPC files, a record batch per ``--row-group`` documents;
- ``text/``: a few plain text files, one document each (at most 2,000 of them: millions of tiny
  files are not what this measures).

Records hold ``id``, ``source`` (the file the excerpt comes from) and ``text``. Generation streams:
one shard's documents are held at a time (plus the source files, about 150 MB, read once). A
``corpus.json`` written last lists the parameters and every shard (documents, text bytes, file
bytes); a folder whose corpus.json has the same parameters is reused as it is.

    python benchmarks/make_corpus.py --docs 5000000 --out runs/bench/data_pipeline/corpus
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import math
import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

VERSION = 1
# (folder, share of the documents); the text folder takes its few documents out of arrow's share
FORMATS = (("parquet", 0.35), ("jsonl_zst", 0.30), ("json_gz", 0.15), ("arrow", 0.20))
TEXT_FILES_MAX = 2000
MAX_DOC_BYTES = 256 << 10
MIN_DOC_BYTES = 16


def log(msg: str) -> None:
    print(f"make_corpus: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the source text


def source_files() -> list[Path]:
    """The local files documents are cut from, in a stable order."""
    std = Path(sysconfig.get_paths()["stdlib"])
    files = [
        p for p in sorted(std.rglob("*.py")) if not {"site-packages", "dist-packages", "__pycache__"} & set(p.parts)
    ]
    inc = Path("/usr/include")
    if inc.is_dir():
        files += [p for p in sorted(inc.rglob("*")) if p.is_file() and not p.is_symlink()]
    return files


def load_pool(files: list[Path]) -> tuple[list[str], list[str]]:
    """(texts, names) of the UTF-8 text files among ``files`` (binary and other encodings left out)."""
    texts, names = [], []
    for p in files:
        try:
            raw = p.read_bytes()
        except OSError:
            continue
        if len(raw) < 64 or b"\0" in raw[:8192]:
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if not text.strip():
            continue
        texts.append(text)
        names.append(str(p))
    return texts, names


def pool_signature(files: list[Path]) -> str:
    h = hashlib.sha256()
    for p in files:
        try:
            h.update(f"{p}\0{p.stat().st_size}\n".encode())
        except OSError:
            continue
    return h.hexdigest()[:16]


class Excerpts:
    """Documents cut from the pool: half from the standard library, half from the headers (each file
    chosen in proportion to its length), lengths lognormal."""

    def __init__(self, texts: list[str], names: list[str], median: float, sigma: float):
        self.texts, self.names = texts, names
        self.median, self.sigma = median, sigma
        lens = np.array([len(t) for t in texts], np.float64)
        is_py = np.array([n.endswith(".py") and not n.startswith("/usr/include") for n in names])
        w = np.where(is_py, lens / max(lens[is_py].sum(), 1), lens / max(lens[~is_py].sum(), 1))
        if is_py.any() and (~is_py).any():
            w = w / 2
        self.cum = np.cumsum(w / w.sum())

    def batch(self, rng: np.random.Generator, n: int) -> tuple[list[str], list[str]]:
        """``n`` documents (texts, source names)."""
        fi = np.minimum(np.searchsorted(self.cum, rng.random(n)), len(self.texts) - 1)
        lengths = np.clip(rng.lognormal(math.log(self.median), self.sigma, n), MIN_DOC_BYTES, MAX_DOC_BYTES).astype(
            np.int64
        )
        where = rng.random(n)
        out, src = [], []
        texts, names = self.texts, self.names
        for f, length, u in zip(fi.tolist(), lengths.tolist(), where.tolist(), strict=True):
            text = texts[f]
            size = len(text)
            if length >= size:
                doc = text
            else:
                start = int(u * (size - length))
                start = text.rfind("\n", 0, start) + 1
                end = text.find("\n", start + length)
                doc = text[start : end + 1 if end != -1 else size]
                if not doc.strip():
                    doc = text[:length]
            out.append(doc)
            src.append(names[f])
        return out, src


# ---------------------------------------------------------------- writers


def _nbytes(docs: list[str]) -> int:
    return sum(len(d) if d.isascii() else len(d.encode("utf-8")) for d in docs)


def write_parquet(path: Path, ids, docs, srcs, row_group: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("id", pa.int64()), ("source", pa.string()), ("text", pa.string())])
    with pq.ParquetWriter(path, schema, compression="snappy") as w:
        for a in range(0, len(docs), row_group):
            b = a + row_group
            w.write_table(pa.table({"id": ids[a:b], "source": srcs[a:b], "text": docs[a:b]}, schema=schema),
                          row_group_size=row_group)  # fmt: skip


def write_arrow(path: Path, ids, docs, srcs, row_group: int) -> None:
    import pyarrow as pa

    schema = pa.schema([("id", pa.int64()), ("source", pa.string()), ("text", pa.string())])
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, schema) as w:
        for a in range(0, len(docs), row_group):
            b = a + row_group
            w.write_batch(pa.record_batch({"id": ids[a:b], "source": srcs[a:b], "text": docs[a:b]}, schema=schema))


def _lines(ids, docs, srcs):
    dumps = json.dumps
    return "".join(dumps({"id": i, "source": s, "text": d}) + "\n" for i, d, s in zip(ids, docs, srcs, strict=True))


def write_jsonl_zst(path: Path, ids, docs, srcs, row_group: int) -> None:
    import zstandard

    with open(path, "wb") as fh, zstandard.ZstdCompressor(level=3).stream_writer(fh) as z:
        for a in range(0, len(docs), row_group):
            b = a + row_group
            z.write(_lines(ids[a:b], docs[a:b], srcs[a:b]).encode("utf-8"))


def write_json_gz(path: Path, ids, docs, srcs, row_group: int) -> None:
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6, mtime=0) as z:
        for a in range(0, len(docs), row_group):
            b = a + row_group
            z.write(_lines(ids[a:b], docs[a:b], srcs[a:b]).encode("utf-8"))


WRITERS = {
    "parquet": (write_parquet, ".parquet"),
    "jsonl_zst": (write_jsonl_zst, ".jsonl.zst"),
    "json_gz": (write_json_gz, ".json.gz"),
    "arrow": (write_arrow, ".arrow"),
}


# ---------------------------------------------------------------- the corpus


def plan(docs: int) -> dict[str, int]:
    """Documents per folder."""
    n_text = min(TEXT_FILES_MAX, max(4, docs // 2500))
    counts = {name: int(docs * share) for name, share in FORMATS}
    counts["parquet"] += docs - sum(counts.values())  # rounding
    counts["arrow"] -= n_text
    counts["text"] = n_text
    return counts


def params_of(args) -> dict:
    return {
        "version": VERSION,
        "docs": args.docs,
        "seed": args.seed,
        "shard_docs": args.shard_docs,
        "row_group": args.row_group,
        "median_bytes": args.median_bytes,
        "sigma": args.sigma,
    }


def read_manifest(out: Path) -> dict | None:
    try:
        return json.loads((out / "corpus.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def make(out: Path, docs: int, seed: int = 0, shard_docs: int = 65536, row_group: int = 8192,
         median_bytes: float = 300.0, sigma: float = 1.0) -> dict:  # fmt: skip
    """The corpus in ``out`` (reused when its corpus.json has these parameters); its manifest."""
    args = argparse.Namespace(docs=docs, seed=seed, shard_docs=shard_docs, row_group=row_group,
                              median_bytes=median_bytes, sigma=sigma)  # fmt: skip
    files = source_files()
    params = params_of(args) | {"pool": pool_signature(files)}
    old = read_manifest(out)
    if old is not None and old.get("params") == params:
        log(f"reusing {out} ({old['documents']:,} documents, {old['text_bytes'] / 1e9:.2f} GB of text, "
            f"{old['file_bytes'] / 1e9:.2f} GB of files)")  # fmt: skip
        return old
    if old is not None:
        log(f"{out} holds a corpus with other parameters; writing it again")
    for sub in [*(n for n, _ in FORMATS), "text", "corpus.json"]:
        p = out / sub
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    log(f"reading the source text ({len(files)} files: the standard library's *.py and /usr/include)")
    texts, names = load_pool(files)
    pool = Excerpts(texts, names, median_bytes, sigma)
    log(f"  {len(texts)} UTF-8 files, {sum(map(len, texts)) / 1e6:.0f} M characters")
    counts = plan(docs)
    log(f"writing {docs:,} documents into {out}: " + ", ".join(f"{n} {c:,}" for n, c in counts.items()))
    shards: list[dict] = []
    total_text = total_file = written = 0
    next_id = 0
    last_say = time.time()
    for fi, (name, _) in enumerate([*FORMATS, ("text", 0)]):
        n = counts[name]
        folder = out / name
        folder.mkdir()
        rng = np.random.default_rng([seed, fi])
        if name == "text":
            body, srcs = pool.batch(rng, n)
            nbytes = 0
            for k, d in enumerate(body):
                p = folder / f"doc-{k:05d}.txt"
                p.write_text(d, encoding="utf-8")
                nbytes += len(d.encode("utf-8"))
            size = sum(p.stat().st_size for p in folder.iterdir())
            shards.append({"path": name, "format": "text", "documents": n, "text_bytes": nbytes, "file_bytes": size})
            total_text += nbytes
            total_file += size
            written += n
            continue
        writer, suffix = WRITERS[name]
        for k, a in enumerate(range(0, n, shard_docs)):
            m = min(shard_docs, n - a)
            body, srcs = pool.batch(rng, m)
            ids = list(range(next_id, next_id + m))
            next_id += m
            path = folder / f"part-{k:05d}{suffix}"
            tmp = folder / f".part-{k:05d}{suffix}.tmp"
            writer(tmp, ids, body, srcs, row_group)
            os.replace(tmp, path)
            nbytes = _nbytes(body)
            size = path.stat().st_size
            shards.append({"path": f"{name}/{path.name}", "format": name, "documents": m, "text_bytes": nbytes,
                           "file_bytes": size})  # fmt: skip
            total_text += nbytes
            total_file += size
            written += m
            if time.time() - last_say >= 10:
                dt = time.time() - t0
                log(f"  {written:,}/{docs:,} documents ({written / docs:.0%}), {total_text / 1e9:.2f} GB of text, "
                    f"{total_text / 1e6 / dt:.1f} MB/s, about {dt * (docs - written) / max(written, 1):.0f} s left")  # fmt: skip
                last_say = time.time()
        log(f"  {name}: {n:,} documents in {len([s for s in shards if s['format'] == name])} shards")
    manifest = {
        "params": params,
        "documents": written,
        "text_bytes": total_text,
        "file_bytes": total_file,
        "seconds": round(time.time() - t0, 1),
        "folders": [n for n, _ in FORMATS] + ["text"],
        "shards": shards,
    }
    tmp = out / ".corpus.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, out / "corpus.json")  # last: the corpus is complete
    log(f"wrote {written:,} documents, {total_text / 1e9:.2f} GB of text in {total_file / 1e9:.2f} GB of files, "
        f"{len(shards)} shards, in {manifest['seconds']:.0f} s")  # fmt: skip
    return manifest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, required=True, help="number of documents")
    ap.add_argument("--out", required=True, help="the corpus folder")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--shard-docs", type=int, default=65536, help="documents per shard (default 65,536: about 30 MB of text)"
    )
    ap.add_argument("--row-group", type=int, default=8192, help="documents per Parquet row group / Arrow record batch")
    ap.add_argument("--median-bytes", type=float, default=300.0, help="median document length (default 300)")
    ap.add_argument("--sigma", type=float, default=1.0, help="lognormal spread of the lengths (default 1.0)")
    a = ap.parse_args()
    make(Path(a.out), a.docs, a.seed, a.shard_docs, a.row_group, a.median_bytes, a.sigma)


if __name__ == "__main__":
    main()
