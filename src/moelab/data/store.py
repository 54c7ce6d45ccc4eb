"""Tokenizer and token store: documents -> byte-level BPE -> one memory-mapped array of tokens.

A store is built once per (sources, their sizes and mtimes, split, tokenizer) and reused while
those are unchanged. It is written to a temporary folder and renamed into place with its
manifest last, so a failed or killed build never leaves a store that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moelab.config import DataConfig
from moelab.data import sources as S

EOT = "<|endoftext|>"
STORE_VERSION = 1


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE with ``EOT`` as token 0; every byte is in its alphabet, so nothing is unknown."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def load_tokenizer(path: str | Path, vocab_size: int):
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises plain Exceptions
        raise S.DataError(f"{path}: not a tokenizer.json ({str(exc).splitlines()[0]})") from None
    if tok.token_to_id(EOT) is None:
        tok.add_special_tokens([EOT])
    if tok.get_vocab_size() > vocab_size:
        raise S.DataError(f"{path}: {tok.get_vocab_size()} tokens, more than model.vocab_size={vocab_size}")
    return tok


def token_byte_lengths(tok) -> np.ndarray:
    """Bytes of text each token id stands for (0 for specials), for bits per byte."""
    n = tok.get_vocab_size()
    out = np.zeros(n, np.int32)
    byte_level = "ByteLevel" in type(tok.pre_tokenizer).__name__ if tok.pre_tokenizer else False
    specials = {tok.token_to_id(EOT)}
    for i in range(n):
        if i in specials:
            continue
        piece = tok.id_to_token(i)
        if piece is None:
            continue
        out[i] = len(piece) if byte_level else len(tok.decode([i]).encode("utf-8"))
    return out


@dataclass
class TokenStore:
    path: Path
    manifest: dict
    tokens: np.ndarray  # memory-mapped, all domains and splits
    byte_lengths: np.ndarray  # [vocab] bytes per token id

    @property
    def domains(self) -> list[str]:
        return list(self.manifest["domains"])

    @property
    def eot(self) -> int:
        return int(self.manifest["eot"])

    def stream(self, domain: str, split: str) -> np.ndarray:
        """A domain's training or held-out tokens, documents joined by EOT. split: train | heldout."""
        start, end = self.manifest["spans"][domain][split]
        return self.tokens[start:end]

    def tokenizer(self):
        return load_tokenizer(self.path / "tokenizer.json", 1 << 31)


def store_key(cfg: DataConfig, vocab_size: int, srcs: list[S.Source]) -> str:
    tokenizer = cfg.tokenizer
    tok_fp = None
    if tokenizer:
        p = Path(tokenizer)
        if not p.is_file():
            raise S.DataError(f"{tokenizer}: no such tokenizer file (data.tokenizer)")
        tok_fp = hashlib.sha256(p.read_bytes()).hexdigest()
    blob = {
        "version": STORE_VERSION,
        "sources": [[s.spec, s.kind, S.fingerprint(s)] for s in srcs],
        "text_field": cfg.text_field,
        "held_out_fraction": cfg.held_out_fraction,
        "max_bytes_per_domain": cfg.max_bytes_per_domain,
        "tokenizer": tok_fp,
        "vocab_size": None if tokenizer else vocab_size,
    }
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]


def _collect(srcs: list[S.Source], cfg: DataConfig) -> dict[str, list[S.Document]]:
    docs: dict[str, list[S.Document]] = {d: [] for s in srcs for d in s.domains}
    size = dict.fromkeys(docs, 0)
    for src in srcs:
        for doc in S.iter_documents(src, cfg.text_field):
            if not doc.text.strip():
                continue
            if cfg.max_bytes_per_domain and size[doc.domain] >= cfg.max_bytes_per_domain:
                continue
            docs[doc.domain].append(doc)
            size[doc.domain] += len(doc.text.encode("utf-8"))
    for src in srcs:
        for d in src.domains:
            if len(docs[d]) < 2:
                raise S.DataError(f"{src.spec}: domain {d!r} has {len(docs[d])} non-empty documents; need 2 or more")
    return docs


def _split(domain: str, docs: list[S.Document], fraction: float) -> tuple[list, list]:
    held = [S.is_held_out(domain, d.doc_id, fraction) for d in docs]
    if not any(held):  # every domain keeps at least one document out of training
        held[min(range(len(docs)), key=lambda i: hashlib.sha256(docs[i].doc_id.encode()).digest())] = True
    if all(held):
        held[0] = False
    return [d for d, h in zip(docs, held, strict=True) if not h], [d for d, h in zip(docs, held, strict=True) if h]


def _encode(tok, docs: list[S.Document], eot: int, bar) -> tuple[list[np.ndarray], list[int]]:
    arrays, counts = [], []
    for i in range(0, len(docs), 256):
        chunk = docs[i : i + 256]
        for enc in tok.encode_batch([d.text for d in chunk]):
            ids = np.asarray(enc.ids + [eot], np.uint32)
            arrays.append(ids)
            counts.append(len(ids))
        bar.update(len(chunk))
    return arrays, counts


def build_store(cfg: DataConfig, vocab_size: int, cache: Path | None = None, progress: bool = True) -> TokenStore:
    """Load the store for these inputs, building it first if there is none that is complete."""
    from tqdm import tqdm

    srcs = S.resolve(cfg.sources)
    key = store_key(cfg, vocab_size, srcs)
    root = Path(cache or S.cache_root())
    final = root / f"store-{key}"
    if (final / "manifest.json").exists():
        return open_store(final)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-store-{key}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.time()
    try:
        docs = _collect(srcs, cfg)
        splits = {d: _split(d, ds, cfg.held_out_fraction) for d, ds in docs.items()}
        if cfg.tokenizer:
            tok = load_tokenizer(cfg.tokenizer, vocab_size)
        else:
            tok = train_tokenizer([d.text for tr, _ in splits.values() for d in tr], vocab_size)
        eot = tok.token_to_id(EOT)
        tmp.mkdir(parents=True)
        tok.save(str(tmp / "tokenizer.json"))
        total_docs = sum(len(v) for v in docs.values())
        spans, manifest_docs, pieces, offset = {}, [], [], 0
        with tqdm(total=total_docs, desc="tokenizing", unit="doc", disable=None if progress else True) as bar:
            for domain, (train, held) in splits.items():
                spans[domain] = {}
                for split, group in (("train", train), ("heldout", held)):
                    arrays, counts = _encode(tok, group, eot, bar)
                    start = offset
                    for doc, n in zip(group, counts, strict=True):
                        manifest_docs.append(
                            {
                                "domain": domain,
                                "split": split,
                                "id": doc.doc_id,
                                "start": offset,
                                "tokens": n,
                                "bytes": len(doc.text.encode("utf-8")),
                            }
                        )
                        offset += n
                    pieces.extend(arrays)
                    spans[domain][split] = [start, offset]
        dtype = np.uint16 if tok.get_vocab_size() <= 1 << 16 else np.uint32
        tokens = np.concatenate(pieces).astype(dtype) if pieces else np.zeros(0, dtype)
        tokens.tofile(tmp / "tokens.bin")
        np.save(tmp / "byte_lengths.npy", token_byte_lengths(tok))
        with open(tmp / "documents.jsonl", "w") as fh:
            for d in manifest_docs:
                fh.write(json.dumps(d) + "\n")
        stats = {
            d: {
                split: {
                    "documents": sum(1 for m in manifest_docs if m["domain"] == d and m["split"] == split),
                    "tokens": spans[d][split][1] - spans[d][split][0],
                    "bytes": sum(m["bytes"] for m in manifest_docs if m["domain"] == d and m["split"] == split),
                }
                for split in ("train", "heldout")
            }
            for d in spans
        }
        manifest = {
            "key": key,
            "version": STORE_VERSION,
            "sources": [{"spec": s.spec, "kind": s.kind, "domains": list(s.domains)} for s in srcs],
            "inputs": {s.spec: hashlib.sha256(json.dumps(S.fingerprint(s)).encode()).hexdigest()[:16] for s in srcs},
            "domains": list(spans),
            "spans": spans,
            "stats": stats,
            "dtype": np.dtype(dtype).name,
            "n_tokens": int(tokens.size),
            "vocab_size": tok.get_vocab_size(),
            "eot": eot,
            "held_out_fraction": cfg.held_out_fraction,
            "build_seconds": round(time.time() - t0, 2),
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))  # last: marks the store complete
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished the same store first
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return open_store(final)


def open_store(path: Path) -> TokenStore:
    manifest = json.loads((path / "manifest.json").read_text())
    tokens = np.memmap(path / "tokens.bin", dtype=manifest["dtype"], mode="r", shape=(manifest["n_tokens"],))
    return TokenStore(path, manifest, tokens, np.load(path / "byte_lengths.npy"))
