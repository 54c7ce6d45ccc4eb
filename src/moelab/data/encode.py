"""Tokenizing the token store's units: one unit's work (``encode_unit``, run in a worker process or a
Ray task) and the runners that do units side by side.

A unit (consecutive shards of one domain) is streamed to ``units/<index>.tok`` (token ids in the
store's dtype) and ``units/<index>.doc`` (one ``DOC`` record per document); it is finished when its
``.json`` is written, so a killed build resumes from the units it finished.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moelab.data import sources as S
from moelab.data import tokenizer as T
from moelab.extras import ray_session

ENCODE_BATCH_CHARS = 1 << 20  # text per tokenizer call while encoding
ENCODE_BATCH_DOCS = 8192
DOC = np.dtype([("tokens", "<u8"), ("bytes", "<u8"), ("hash", "<u8"), ("row", "<u8"), ("file", "<u4")])


@dataclass(frozen=True)
class Unit:
    index: int
    domain: int  # into domains + validation domains
    shards: tuple[int, ...]  # into the domain's shards
    size: int  # input bytes


_TOKS: dict[str, T.Tok] = {}


def _tok_at(folder: str) -> T.Tok:
    if folder not in _TOKS:
        _TOKS[folder] = T.load_saved(folder)
    return _TOKS[folder]


def worker_init() -> None:
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # one process per core: the tokenizer's own threads would compete


def _token_docs(dom: S.Domain, shard: S.Shard, tok: T.Tok, dtype, bad: S.Bad):
    """A file of token ids (``.npy``, or raw ``.bin`` in the store's dtype) cut into documents after
    each end-of-document id; yields (ids, row) per document."""
    try:
        if shard.path.lower().endswith(".npy"):
            ids = np.load(shard.path, mmap_mode="r")
        else:
            ids = np.memmap(shard.path, dtype=dtype, mode="r")
    except (ValueError, OSError) as exc:
        bad.record(shard, shard.path, f"not a file of token ids ({str(exc).splitlines()[0]})")
        return
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        bad.record(shard, shard.path, f"token ids must be a 1-D integer array, got {ids.dtype} {ids.shape}")
        return
    n = tok.vocab_size
    step = 1 << 24
    carry = np.zeros(0, np.uint32)
    row = 0
    for lo in range(0, len(ids), step):
        chunk = np.asarray(ids[lo : lo + step])
        if len(chunk) and (chunk.min() < 0 or chunk.max() >= n):
            bad.record(shard, shard.path, f"token id {int(chunk.max())} is outside the tokenizer's {n} ids")
            return
        chunk = np.concatenate([carry, chunk.astype(np.uint32)])
        ends = np.flatnonzero(chunk == tok.eos) + 1
        start = 0
        for e in ends:
            yield chunk[start:e], row
            row += 1
            start = e
        carry = chunk[start:]
    if len(carry):
        yield np.concatenate([carry, np.array([tok.eos], np.uint32)]), row


def encode_unit(job: dict) -> dict:
    """Tokenize one unit into ``units/<index>.{tok,doc}`` (and ``.msk`` for conversations) and mark it
    finished with ``.json``."""
    # long (91 lines): the unit's shards, their documents and the batched flushes share its open files and counts
    dom: S.Domain = job["domain"]
    unit: Unit = job["unit"]
    out = Path(job["dir"]) / "units"
    name = f"{unit.index:06d}"
    tok = _tok_at(job["tokenizer"])
    dtype = np.dtype(job["dtype"])
    bad = S.Bad(skip=job["skip"])
    left_out: list[str] = []
    tmp_tok, tmp_doc = out / f".{name}.tok", out / f".{name}.doc"
    stats = {"documents": 0, "tokens": 0, "bytes": 0}
    blen = None
    with open(tmp_tok, "wb") as ftok, open(tmp_doc, "wb") as fdoc:
        texts: list[str] = []
        spans: list[tuple] = []  # a conversation's assistant characters (chat domains)
        meta: list[tuple[int, int, int, int]] = []  # (bytes, hash, row, file)
        chars = 0
        fmask = open(out / f".{name}.msk", "wb") if dom.chat is not None else None

        def flush():
            if fmask is None:
                ids, lengths = T.encode(tok, texts)
            else:  # with offsets: each token's mask, 1 where it starts in an assistant's turn
                encs = tok.tokenizer.encode_batch(texts, add_special_tokens=False)
                ids, lengths = T.flatten(tok, encs)
                loss_mask(tok, encs, spans).tofile(fmask)
                spans.clear()
            ids.astype(dtype, copy=False).tofile(ftok)
            rec = np.empty(len(texts), DOC)
            m = np.asarray(meta, np.uint64).reshape(-1, 4)
            rec["tokens"], rec["bytes"], rec["hash"], rec["row"], rec["file"] = (
                lengths,
                m[:, 0],
                m[:, 1],
                m[:, 2],
                m[:, 3],
            )
            rec.tofile(fdoc)
            stats["documents"] += len(texts)
            stats["tokens"] += int(lengths.sum())
            stats["bytes"] += int(m[:, 0].sum())
            texts.clear()
            meta.clear()

        for fi, si in enumerate(unit.shards):
            shard = dom.shards[si]
            if shard.fmt == "tokens":
                if blen is None:
                    blen = T.byte_lengths(tok)
                for ids, row in _token_docs(dom, shard, tok, dtype, bad):
                    ids.astype(dtype).tofile(ftok)
                    rec = np.zeros(1, DOC)
                    rec["tokens"], rec["bytes"] = len(ids), int(blen[ids].sum())
                    rec["hash"], rec["row"], rec["file"] = S.doc_hash(dom.name, f"{shard.rel}#{row}"), row, fi
                    rec.tofile(fdoc)
                    stats["documents"] += 1
                    stats["tokens"] += len(ids)
                    stats["bytes"] += int(rec["bytes"][0])
                continue
            for doc in S.iter_shard(dom, shard, bad, left_out, tmp_dir=str(out)):
                if not doc.text.strip():
                    continue
                for piece in S.pieces(doc, S.MAX_PIECE_CHARS):
                    text = piece.text
                    texts.append(text)
                    spans.append(piece.spans)
                    meta.append((len(text) if text.isascii() else len(text.encode("utf-8")),
                                 S.doc_hash(dom.name, piece.doc_id), piece.row, fi))  # fmt: skip
                    chars += len(text)
                    if chars >= ENCODE_BATCH_CHARS or len(texts) >= ENCODE_BATCH_DOCS:
                        flush()
                        chars = 0
        if texts:
            flush()
        if fmask is not None:
            fmask.close()
            os.replace(out / f".{name}.msk", out / f"{name}.msk")
    os.replace(tmp_tok, out / f"{name}.tok")
    os.replace(tmp_doc, out / f"{name}.doc")
    stats.update(
        unit=unit.index,
        files=[dom.shards[si].rel for si in unit.shards],
        left_out=left_out,
        bad=bad.shards,
        size=unit.size,
    )
    tmp = out / f".{name}.json"
    tmp.write_text(json.dumps(stats))
    os.replace(tmp, out / f"{name}.json")  # last: the unit is finished
    return stats


def loss_mask(tok: T.Tok, encodings, spans: list[tuple]) -> np.ndarray:
    """Each token's loss mask (uint8), laid out as ``T.encode`` lays out the documents ([bos] + ids +
    [eos]): 1 for a token that starts inside one of its document's ``spans`` (the assistant's turns),
    0 for every other token, the bos and the eos."""
    parts = []
    for enc, doc_spans in zip(encodings, spans, strict=True):
        starts = np.fromiter((a for a, _ in enc.offsets), np.int64, len(enc.offsets))
        m = np.zeros(len(starts), bool)
        for a, b in doc_spans:
            m |= (starts >= a) & (starts < b)
        parts += [np.zeros(int(bool(tok.add_bos)), np.uint8), m.astype(np.uint8), np.zeros(1, np.uint8)]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8)


class Local:
    """Units in ``workers`` processes on this machine (spawned), or in this process when one."""

    def __init__(self, workers: int, fn):
        self.fn = fn  # what a unit is given to: encode_unit
        self.pool = None
        if workers > 1:
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor

            self.pool = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=worker_init)
        self.pending: dict = {}

    def submit(self, job: dict, tag) -> None:
        if self.pool is None:
            self.pending[tag] = job  # run in this process when waited for
        else:
            self.pending[self.pool.submit(self.fn, job)] = tag

    def wait(self):
        """(tag, stats) of a finished unit."""
        if self.pool is None:
            tag, job = next(iter(self.pending.items()))
            del self.pending[tag]
            return tag, self.fn(job)
        from concurrent.futures import FIRST_COMPLETED, wait

        done, _ = wait(list(self.pending), return_when=FIRST_COMPLETED)
        fut = next(iter(done))
        tag = self.pending.pop(fut)
        return tag, fut.result()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


class Ray:
    """One Ray task per unit (moelab.extras.ray_session starts or joins the cluster). The build folder
    must be on storage every node sees (MOELAB_CACHE)."""

    def __init__(self, fn):
        self.ray = ray_session()
        self.remote = self.ray.remote(num_cpus=1, runtime_env={"env_vars": {"RAYON_NUM_THREADS": "1"}})(fn)
        self.pending: dict = {}

    def submit(self, job: dict, tag) -> None:
        self.pending[self.remote.remote(job)] = tag

    def wait(self):
        (ref,), _ = self.ray.wait(list(self.pending), num_returns=1)
        tag = self.pending.pop(ref)
        return tag, self.ray.get(ref)

    def close(self) -> None:
        for ref in self.pending:
            self.ray.cancel(ref)
