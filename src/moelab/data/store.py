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
    if cfg.include or cfg.exclude:  # (absent otherwise: the keys of stores built before stay)
        blob["globs"] = [list(cfg.include), list(cfg.exclude)]
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]


SINGLE_DOC_PIECES = 20  # a domain of one document is cut into this many pieces, by position
MIN_PIECE_CHARS = 256  # ... each at least this long
TOKENIZER_CHARS = 64 << 20  # the tokenizer learns from at most this much text, shared out over the domains
ENCODE_BATCH_CHARS = 1 << 20  # text per tokenizer call while encoding (an Encoding holds ~100 bytes a token)


def _pieces(doc: S.Document, size: int):
    """``doc``, or its pieces of at most ``size`` characters cut after a newline where one is near."""
    text = doc.text
    if len(text) <= size:
        yield doc
        return
    start, k = 0, 0
    while start < len(text):
        end = min(start + size, len(text))
        if end < len(text):
            nl = text.rfind("\n", start + size // 2, end)
            end = nl + 1 if nl != -1 else end
        yield S.Document(doc.domain, f"{doc.doc_id}#{k}", text[start:end])
        start, k = end, k + 1


def _documents(
    srcs: list[S.Source], cfg: DataConfig, domain: str | None = None, piece: dict | None = None, skipped=None
):
    """The documents the store holds, in order: non-empty, within ``data.max_bytes_per_domain``
    (whole documents counted), cut into pieces; those of ``domain`` only when it is given. Each
    pass reads the sources again, so nothing but the current document is held."""
    piece = piece or {}
    for src in srcs:
        if domain is not None and domain not in src.domains:
            continue
        size = dict.fromkeys(src.domains, 0)
        for doc in S.iter_documents(src, cfg.text_field, skipped):
            if domain is not None and doc.domain != domain:
                continue
            if not doc.text.strip():
                continue
            if cfg.max_bytes_per_domain:
                if size[doc.domain] >= cfg.max_bytes_per_domain:
                    continue
                size[doc.domain] += len(doc.text.encode("utf-8"))
            yield from _pieces(doc, piece.get(doc.domain, S.MAX_PIECE_CHARS))


def _index(srcs: list[S.Source], cfg: DataConfig, skipped=None) -> tuple[dict[str, list[str]], dict[str, int]]:
    """Each domain's document ids in order, and the piece size per domain (a domain of one document
    is cut by position, so that part of it can be held out)."""
    ids: dict[str, list[str]] = {d: [] for s in srcs for d in s.domains}
    chars = dict.fromkeys(ids, 0)
    for doc in _documents(srcs, cfg, skipped=skipped):
        ids[doc.domain].append(doc.doc_id)
        chars[doc.domain] += len(doc.text)
    piece = {}
    for d, n in ids.items():
        if len(n) < 2 and chars[d] >= 2 * MIN_PIECE_CHARS:
            piece[d] = max(MIN_PIECE_CHARS, -(-chars[d] // SINGLE_DOC_PIECES))
    if piece:
        for d in piece:
            ids[d] = [doc.doc_id for doc in _documents(srcs, cfg, d, piece)]
    for src in srcs:
        for d in src.domains:
            if len(ids[d]) < 2:
                raise S.DataError(
                    f"{src.spec}: domain {d!r} has {len(ids[d])} non-empty documents, too little text to hold "
                    f"part out ({chars[d]} characters; need {2 * MIN_PIECE_CHARS} or more)"
                )
    return ids, piece


def _split(domain: str, ids: list[str], fraction: float) -> list[bool]:
    """Which documents are held out: a hash of each name, and at least one on each side."""
    held = [S.is_held_out(domain, i, fraction) for i in ids]
    if not any(held):  # every domain keeps at least one document out of training
        held[min(range(len(ids)), key=lambda i: hashlib.sha256(ids[i].encode()).digest())] = True
    if all(held):
        held[0] = False
    return held


def _encode(tok, texts: list[str], eot: int) -> list[np.ndarray]:
    return [np.asarray(enc.ids + [eot], np.uint32) for enc in tok.encode_batch_fast(texts)]


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def _encode_domain(tok, docs, held: dict, eot: int, dtype, train_out, held_out, bar) -> dict[str, list]:
    """Encode one domain's documents in batches of bounded text, each to its split's file as it
    comes; per split, (id, tokens, bytes) of each document in order."""
    counts: dict[str, list] = {"train": [], "heldout": []}
    batch: list[S.Document] = []
    chars = 0

    def flush():
        for doc, arr in zip(batch, _encode(tok, [x.text for x in batch], eot), strict=True):
            split = "heldout" if held[doc.doc_id] else "train"
            arr.astype(dtype).tofile(held_out if split == "heldout" else train_out)
            counts[split].append((doc.doc_id, len(arr), _utf8_len(doc.text)))
        bar.update(len(batch))
        batch.clear()

    for doc in docs:
        batch.append(doc)
        chars += len(doc.text)
        if chars >= ENCODE_BATCH_CHARS or len(batch) >= 256:
            flush()
            chars = 0
    if batch:
        flush()
    return counts


def _clean_stale(root: Path) -> None:
    """Temporary stores of builds whose process is gone (killed, out of memory) are removed."""
    for tmp in root.glob(".tmp-store-*"):
        try:
            pid = int(tmp.name.rsplit("-", 1)[1])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except (ValueError, IndexError, PermissionError):
            continue


def build_store(cfg: DataConfig, vocab_size: int, cache: Path | None = None, progress: bool = True) -> TokenStore:
    """Load the store for these inputs, building it first if there is none that is complete.

    The build streams: the sources are read once to index the documents, once per domain to train
    the tokenizer and once per domain to encode, and tokens go to disk as they come, so memory does
    not grow with the corpus (a document longer than sources.MAX_PIECE_CHARS is cut into pieces)."""
    from moelab.progress import Progress, say

    srcs = S.resolve(cfg.sources, cfg.include, cfg.exclude)
    key = store_key(cfg, vocab_size, srcs)
    root = Path(cache or S.cache_root())
    final = root / f"store-{key}"
    if (final / "manifest.json").exists():
        return open_store(final)
    root.mkdir(parents=True, exist_ok=True)
    _clean_stale(root)
    tmp = root / f".tmp-store-{key}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.time()
    try:
        say(f"indexing the documents of {', '.join(cfg.sources)}", progress)
        skipped: list = []
        ids, piece = _index(srcs, cfg, skipped)
        if skipped:
            names = ", ".join(str(p) for p in skipped[:3]) + (", ..." if len(skipped) > 3 else "")
            say(f"left out {len(skipped)} files that are binary or not UTF-8 text ({names})", progress)
        held = {d: dict(zip(i, _split(d, i, cfg.held_out_fraction), strict=True)) for d, i in ids.items()}
        if cfg.tokenizer:
            tok = load_tokenizer(cfg.tokenizer, vocab_size)
        else:
            say(
                f"training a {vocab_size}-token byte-level BPE tokenizer on up to {TOKENIZER_CHARS >> 20} MB of the "
                "training documents",
                progress,
            )

            share = TOKENIZER_CHARS // len(ids)

            def texts():
                for d in ids:  # each domain's training documents in order, up to its share
                    seen = 0
                    for doc in _documents(srcs, cfg, d, piece):
                        if seen >= share:
                            break
                        if not held[d][doc.doc_id]:
                            yield doc.text
                            seen += len(doc.text)

            tok = train_tokenizer(texts(), vocab_size)
        eot = tok.token_to_id(EOT)
        tmp.mkdir(parents=True)
        tok.save(str(tmp / "tokenizer.json"))
        dtype = np.uint16 if tok.get_vocab_size() <= 1 << 16 else np.uint32
        total_docs = sum(len(v) for v in ids.values())
        spans, manifest_docs, offset = {}, [], 0
        with (
            open(tmp / "tokens.bin", "wb") as out,
        ):
            bar = Progress(total_docs, desc="tokenizing", unit="document", enabled=progress)
            for domain in ids:
                # the held-out documents go after the domain's training ones: kept apart until then
                side = tmp / f"heldout-{len(spans)}.bin"
                with open(side, "wb") as held_out:
                    counts = _encode_domain(
                        tok, _documents(srcs, cfg, domain, piece), held[domain], eot, dtype, out, held_out, bar
                    )
                with open(side, "rb") as fh:
                    shutil.copyfileobj(fh, out, 16 << 20)
                side.unlink()
                spans[domain] = {}
                for split in ("train", "heldout"):
                    start = offset
                    for doc_id, n, nbytes in counts[split]:
                        manifest_docs.append(
                            {
                                "domain": domain,
                                "split": split,
                                "id": doc_id,
                                "start": offset,
                                "tokens": n,
                                "bytes": nbytes,
                            }
                        )
                        offset += n
                    spans[domain][split] = [start, offset]
            bar.close()
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
            "n_tokens": int(offset),
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
