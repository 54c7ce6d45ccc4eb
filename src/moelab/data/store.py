"""The token store: every domain's documents tokenized into one memory-mapped array.

A store is built once per (sources and their shards' sizes and stamps, split, tokenizer) and
reused while those are unchanged. The build:
1. resolves the sources into domains of shards (moelab.data.sources) and groups each domain's
   shards, in order, into units of about ``UNIT_BYTES`` (a large shard is a unit of its own);
2. trains a byte-level BPE on up to ``TOKENIZER_CHARS`` of the training documents (or loads
   ``data.tokenizer``);
3. tokenizes the units in parallel, ``data.workers`` processes on this machine (default: every
   core) or one Ray task per unit (``data.backend: ray``), each unit streamed to its own token and
   document files under ``.build-store-<key>/units``; a unit is finished when its ``.json`` is
   written, so a build that is killed resumes from the units it finished;
4. assembles the units in order: per domain, its training documents, then its held-out ones.

Each worker holds one unit's current batch of text; the assembly holds one domain's held-out
index. The store's bytes depend only on the inputs, never on the workers, their number, their
order or the backend. The store is renamed into place with its manifest written last, so a failed
or killed build never leaves a store that looks complete.

The held-out split (``data.held_out_fraction`` f): a document is held out when a hash of its domain
and name falls below f (stable across runs, machines, file order and workers; the expected share
is f). A domain where that holds out none of its documents, or all of them (a domain of few
documents: with n documents, none is held out with probability (1 - f)^n), is split by position
instead: its last ceil(f x tokens) tokens are held out. f = 0 holds out nothing. Validation
sources (``data.validation``) are held out whole and never trained on.

Here: the build (planning the units, running them, assembling the store). One unit's tokenizing and
the runners (processes, Ray tasks) are in ``moelab.data.encode``; reading a built store
(``TokenStore``, ``open_store``) is ``moelab.data.tokenstore``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import shutil
import time
from pathlib import Path

import numpy as np

from moelab.config import DataConfig
from moelab.data import sources as S
from moelab.data import tokenizer as T
from moelab.data.chat import SPECIAL_TOKENS
from moelab.data.encode import (  # noqa: F401 - the batch sizes, importable from here
    DOC,
    ENCODE_BATCH_CHARS,
    ENCODE_BATCH_DOCS,
    Local,
    Ray,
    Unit,
    encode_unit,
)
from moelab.data.tokenstore import INDEX, TokenStore, open_store
from moelab.progress import Progress, say

EOT = "<|endoftext|>"
STORE_VERSION = 2
UNIT_BYTES = 32 << 20  # consecutive shards of a domain are tokenized together up to this many bytes
TOKENIZER_CHARS = 64 << 20  # the tokenizer learns from at most this much text, shared out over the domains
QUIET_BYTES = 4 << 20  # a build from less input than this says nothing (it takes a second or two)


def train_tokenizer(texts, vocab_size: int):
    """A byte-level BPE with ``EOT`` as token 0 (the ``tokenizers`` object)."""
    return T.train(texts, vocab_size).tokenizer


def store_key(cfg: DataConfig, vocab_size: int, domains: list[S.Domain], vdomains: list[S.Domain], tokenizer_fp) -> str:
    blob = {
        "version": STORE_VERSION,
        "domains": [S.fingerprint(d) for d in domains],
        "validation": [S.fingerprint(d) for d in vdomains],
        "held_out_fraction": cfg.held_out_fraction,
        "max_bytes_per_domain": cfg.max_bytes_per_domain,
        "bad_records": cfg.bad_records,
        "tokenizer": tokenizer_fp,
        "vocab_size": None if tokenizer_fp else vocab_size,
        "globs": [list(cfg.include), list(cfg.exclude)],
        "pieces": S.MAX_PIECE_CHARS,
    }
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]


# ---------------------------------------------------------------- units of work


def plan_units(domains: list[S.Domain]) -> list[Unit]:
    """Consecutive shards of each domain, grouped up to UNIT_BYTES (a function of the shard list only)."""
    units: list[Unit] = []
    for di, dom in enumerate(domains):
        group: list[int] = []
        size = 0
        for si, shard in enumerate(dom.shards):
            if group and size + shard.size > UNIT_BYTES:
                units.append(Unit(len(units), di, tuple(group), size))
                group, size = [], 0
            group.append(si)
            size += max(shard.size, 1)
        if group:
            units.append(Unit(len(units), di, tuple(group), size))
    return units


def _run_units(units, domains, build: Path, tok_dir: Path, dtype, cfg: DataConfig, workers: int, progress: bool):
    """Tokenize the units not yet finished; a domain past data.max_bytes_per_domain gets no more."""
    done: dict[int, dict] = {}
    for u in units:
        marker = build / "units" / f"{u.index:06d}.json"
        if marker.exists():
            done[u.index] = json.loads(marker.read_text())
    todo = [u for u in units if u.index not in done]
    cap = cfg.max_bytes_per_domain

    def capped(di: int) -> bool:  # the domain's finished prefix of units already reaches the cap
        if not cap:
            return False
        total = 0
        for u in units:
            if u.domain != di:
                continue
            if u.index not in done:
                return False
            total += done[u.index]["bytes"]
            if total >= cap:
                return True
        return False

    if done:
        say(f"resuming the token store's build: {len(done)} of {len(units)} units already done", progress)
    if not todo:
        return done
    n = max(1, min(workers, len(todo)))
    total_mb = sum(u.size for u in todo) / 1e6
    bar = Progress(max(1, round(total_mb)), desc="tokenizing", unit="MB", enabled=progress)
    say(
        f"tokenizing {len(todo)} units ({total_mb:,.0f} MB in {sum(len(u.shards) for u in todo)} shards) with "
        f"{n} {'Ray tasks at a time' if cfg.backend == 'ray' else 'worker processes' if n > 1 else 'process'}",
        progress,
    )
    runner = Ray(encode_unit) if cfg.backend == "ray" else Local(n, encode_unit)  # encode_unit: this module's
    t0 = time.monotonic()
    queue = list(todo)
    text_bytes = docs = tokens = 0
    in_flight = 0
    try:
        while queue or in_flight:
            while queue and in_flight < n:
                u = queue.pop(0)
                if capped(u.domain):
                    continue
                dom = domains[u.domain]  # only the unit's own shards travel with its job
                part = S.Domain(
                    dom.name, dom.spec, tuple(dom.shards[i] for i in u.shards), dom.text_field, chat=dom.chat
                )
                job = {"domain": part, "unit": Unit(u.index, u.domain, tuple(range(len(u.shards))), u.size),
                       "dir": str(build), "tokenizer": str(tok_dir), "dtype": np.dtype(dtype).name,
                       "skip": cfg.bad_records == "skip"}  # fmt: skip
                runner.submit(job, u.index)
                in_flight += 1
            if not in_flight:
                break
            index, stats = runner.wait()
            in_flight -= 1
            done[index] = stats
            text_bytes += stats["bytes"]
            docs += stats["documents"]
            tokens += stats["tokens"]
            dt = max(time.monotonic() - t0, 1e-9)
            bar.set_postfix(
                **{"MB/s": f"{text_bytes / 1e6 / dt:.1f}", "documents": f"{docs:,}", "tokens": f"{tokens:,}"}
            )
            bar.update(round(stats["size"] / 1e6) if bar.n + round(stats["size"] / 1e6) <= bar.total else 0)
    finally:
        runner.close()
    bar.n = bar.total
    bar.close()
    return done


# ---------------------------------------------------------------- assembly


ASSEMBLE_DOCS = 1 << 20  # documents of the index handled at a time while assembling


def _doc_chunks(build: Path, unit: Unit, skip: int = 0):
    """A unit's document records in chunks of ASSEMBLE_DOCS (memory-mapped, never whole)."""
    path = build / "units" / f"{unit.index:06d}.doc"
    n = path.stat().st_size // DOC.itemsize
    if not n:
        return
    docs = np.memmap(path, dtype=DOC, mode="r", shape=(n,))
    for lo in range(0, n, ASSEMBLE_DOCS):
        yield lo, np.array(docs[lo : lo + ASSEMBLE_DOCS])


def _kept(build: Path, units: list[Unit], cap: int):
    """(unit, first doc, chunk) of a domain's documents in order, within data.max_bytes_per_domain
    (whole documents: one is kept while the text before it is under the cap)."""
    size = 0
    for u in units:
        for lo, docs in _doc_chunks(build, u):
            if cap:
                before = size + np.concatenate([[0], np.cumsum(docs["bytes"], dtype=np.int64)[:-1]])
                docs = docs[before < cap]
            size += int(docs["bytes"].sum())
            yield u, lo, docs
            if cap and size >= cap:
                return


def _assemble(units, domains: list[S.Domain], n_train: int, done: dict, build: Path, tmp: Path, dtype, cfg) -> dict:
    """Write tokens.bin and documents.bin in order; return the spans and statistics. Streams: a
    domain's documents are read in chunks twice (to count what hashing holds out, then to write),
    its held-out tokens and index rows go to side files appended after its training ones."""
    # long (102 lines): the two passes over a domain's documents write its tokens, loss mask, index rows and held-out side files in step; apart, they would pass a dozen open files and counters
    f = cfg.held_out_fraction
    cap = cfg.max_bytes_per_domain
    spans, stats, bads, left = {}, {}, {}, {}
    offset = 0
    itemsize = np.dtype(dtype).itemsize
    by_domain: dict[int, list[Unit]] = {}
    for u in units:
        if u.index in done:  # a unit past the byte cap was never tokenized
            by_domain.setdefault(u.domain, []).append(u)
    # conversations' loss masks (moelab.data.encode.loss_mask): mask.bin beside tokens.bin, one byte per
    # token, 1 where a token counts in the loss (every token of a domain that is not conversations)
    masked = any((build / "units" / f"{i:06d}.msk").exists() for i in done)
    mout = open(tmp / "mask.bin", "wb") if masked else None  # noqa: SIM115 - closed below
    with open(tmp / "tokens.bin", "wb") as out, open(tmp / "documents.bin", "wb") as index:
        for di, dom in enumerate(domains):
            validation = di >= n_train
            mine = by_domain.get(di, [])
            for u in mine:
                for rel, entry in done[u.index].get("bad", {}).items():
                    bads.setdefault(dom.name, {})[rel] = entry
                if done[u.index].get("left_out"):
                    left.setdefault(dom.name, []).extend(done[u.index]["left_out"])
            n_docs, n_held = _held_by_hash(build, mine, cap, f)  # pass 1
            if not n_docs:
                raise _no_text(dom, left.get(dom.name))
            by_position = bool(f > 0 and not validation and n_held in (0, n_docs))
            domain_start = offset
            side_off = first = 0
            held_docs = tok_held = bytes_held = bytes_all = 0
            side_tok, side_idx = tmp / f".heldout-{di}.bin", tmp / f".heldout-{di}.idx"
            side_msk = tmp / f".heldout-{di}.msk"
            mside = open(side_msk, "wb") if masked else None  # noqa: SIM115 - closed below
            with open(side_tok, "wb") as side, open(side_idx, "wb") as side_index:
                for u, lo, docs in _kept(build, mine, cap):  # pass 2: write
                    if validation:
                        held = np.ones(len(docs), bool)
                    elif f > 0 and not by_position:
                        held = docs["hash"].astype(np.float64) / 2.0**64 < f
                    else:
                        held = np.zeros(len(docs), bool)
                    path = build / "units" / f"{u.index:06d}.tok"
                    n_tok = path.stat().st_size // itemsize
                    tokens = np.memmap(path, dtype=dtype, mode="r", shape=(n_tok,)) if n_tok else np.zeros(0, dtype)
                    mpath = path.with_suffix(".msk")
                    mask = (
                        np.memmap(mpath, np.uint8, mode="r", shape=(n_tok,))
                        if masked and mpath.exists() and n_tok
                        else None
                    )
                    if lo == 0:  # a unit's first chunk: its tokens start at the top of its file
                        first = 0
                    starts = first + np.concatenate([[0], np.cumsum(docs["tokens"], dtype=np.int64)])
                    first = int(starts[-1])
                    rows = np.empty(len(docs), INDEX)
                    rows["domain"], rows["unit"], rows["file"], rows["row"] = di, u.index, docs["file"], docs["row"]
                    rows["tokens"], rows["bytes"], rows["split"] = docs["tokens"], docs["bytes"], held
                    # runs of equal split, each written with one call
                    cuts = np.concatenate([[0], np.flatnonzero(np.diff(held.astype(np.int8))) + 1, [len(docs)]])
                    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
                        if a == b:
                            continue
                        chunk = np.ascontiguousarray(tokens[starts[a] : starts[b]])
                        if masked:
                            mchunk = np.ones(len(chunk), np.uint8) if mask is None else mask[starts[a] : starts[b]]
                            (mside if held[a] else mout).write(np.ascontiguousarray(mchunk).tobytes())
                        if held[a]:
                            rows["start"][a:b] = side_off + (starts[a:b] - starts[a])
                            side_off += len(chunk)
                            side.write(chunk.tobytes())
                        else:
                            rows["start"][a:b] = offset + (starts[a:b] - starts[a])
                            offset += len(chunk)
                            out.write(chunk.tobytes())
                    rows[~held].tofile(index)
                    rows[held].tofile(side_index)
                    held_docs += int(held.sum())
                    tok_held += int(docs["tokens"][held].sum())
                    bytes_held += int(docs["bytes"][held].sum())
                    bytes_all += int(docs["bytes"].sum())
                    del tokens, mask
            train_end = offset
            if masked:
                mside.close()
                with open(side_msk, "rb") as fh:
                    shutil.copyfileobj(fh, mout, 16 << 20)
                side_msk.unlink()
            _append_held(out, index, side_tok, side_idx, train_end)
            offset += side_off
            split = "position" if by_position else "validation" if validation else "hash"
            held_counts = (held_docs, tok_held, bytes_held, bytes_all)
            spans[dom.name], stats[dom.name] = _split_stats(
                f, split, domain_start, train_end, offset, n_docs, held_counts
            )
    assert (tmp / "tokens.bin").stat().st_size == offset * itemsize
    if masked:
        mout.close()
        assert (tmp / "mask.bin").stat().st_size == offset
    return {"spans": spans, "stats": stats, "bad": bads, "left_out": left, "n_tokens": int(offset), "mask": masked}


def _held_by_hash(build: Path, units: list[Unit], cap: int, f: float) -> tuple[int, int]:
    """How many documents a domain keeps, and how many of them hashing holds out."""
    n_docs = n_held = 0
    for _, _, docs in _kept(build, units, cap):
        n_docs += len(docs)
        if f > 0:
            n_held += int(np.count_nonzero(docs["hash"].astype(np.float64) / 2.0**64 < f))
    return n_docs, n_held


def _no_text(dom: S.Domain, names: list[str] | None) -> S.DataError:
    """The error for a domain that kept no document: its files were not text (``names``: those left
    out), or its documents were all empty."""
    if names:
        return S.DataError(
            f"{dom.spec}: no UTF-8 text files among {len(names)} files ({len(names)} binary or not UTF-8: "
            f"{', '.join(n.rsplit('/', 1)[-1] for n in names[:3])}{', ...' if len(names) > 3 else ''}); "
            "name a directory of text, or change data.include / data.exclude"
        )
    return S.DataError(f"{dom.spec}: domain {dom.name!r} has no documents with text")


def _append_held(out, index, side_tok: Path, side_idx: Path, train_end: int) -> None:
    """A domain's held-out tokens and index rows (from its side files, their starts moved past its
    training tokens) appended after its training ones, ASSEMBLE_DOCS rows at a time; the side files
    removed."""
    with open(side_tok, "rb") as side:
        shutil.copyfileobj(side, out, 16 << 20)
    n_side = side_idx.stat().st_size // INDEX.itemsize
    if n_side:
        held_rows = np.memmap(side_idx, dtype=INDEX, mode="r", shape=(n_side,))
        for lo in range(0, n_side, ASSEMBLE_DOCS):
            r = np.array(held_rows[lo : lo + ASSEMBLE_DOCS])
            r["start"] += train_end
            r.tofile(index)
        del held_rows
    side_tok.unlink()
    side_idx.unlink()


def _split_stats(f: float, split: str, start: int, train_end: int, end: int, n_docs: int, held: tuple) -> tuple:
    """A domain's spans in tokens.bin and its statistics: its tokens are [start, end), its training
    ones before train_end. split: position (its last ceil(f x tokens) held out), hash or validation
    (its held-out documents after the training ones); held: (held-out documents, tokens, bytes; all
    its bytes)."""
    held_docs, tok_held, bytes_held, bytes_all = held
    bytes_train = bytes_all - bytes_held
    if split == "position":
        total = train_end - start
        cut = train_end - max(1, math.ceil(f * total))
        share = (train_end - cut) / max(total, 1)
        span = {"train": [start, cut], "heldout": [cut, train_end]}
        return span, {
            "train": {"documents": n_docs, "tokens": cut - start, "bytes": round(bytes_train * (1 - share))},
            "heldout": {"documents": 0, "tokens": train_end - cut, "bytes": round(bytes_train * share)},
            "split": "position",
        }
    span = {"train": [start, train_end], "heldout": [train_end, end]}
    return span, {
        "train": {"documents": n_docs - held_docs, "tokens": train_end - start, "bytes": bytes_train},
        "heldout": {"documents": held_docs, "tokens": tok_held, "bytes": bytes_held},
        "split": split,
    }


@contextlib.contextmanager
def _lock(path: Path, progress: bool):
    fh = open(path, "a+")
    try:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another process that builds this token store ({path.name})", progress)
            fcntl.flock(fh, fcntl.LOCK_EX)
        yield
    finally:
        fh.close()


def _clean_stale(root: Path) -> None:
    """Temporary stores of assemblies whose process is gone (killed, out of memory) are removed."""
    for tmp in root.glob(".tmp-store-*"):
        try:
            pid = int(tmp.name.rsplit("-", 1)[1])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except (ValueError, IndexError, PermissionError):
            continue


def _tokenizer_texts(domains: list[S.Domain], cfg: DataConfig, bad: S.Bad):
    """Training documents (not held out) of each domain in order, up to its share of TOKENIZER_CHARS."""
    share = TOKENIZER_CHARS // max(1, len(domains))
    for dom in domains:
        seen = 0
        for doc in S.iter_documents(dom, bad, []):
            if seen >= share:
                break
            if not doc.text.strip():
                continue
            for piece in S.pieces(doc, S.MAX_PIECE_CHARS):
                if not S.is_held_out(dom.name, piece.doc_id, cfg.held_out_fraction):
                    yield piece.text
                    seen += len(piece.text)


def resolve_all(cfg: DataConfig) -> tuple[list[S.Domain], list[S.Domain]]:
    # data.text_field names training and validation domains alike: checked against both together
    domains = S.resolve(cfg.sources, cfg.include, cfg.exclude, cfg.text_field, other_domains=None,
                        chat_tokenizer=cfg.tokenizer)  # fmt: skip
    vdomains = []
    if cfg.validation:
        vdomains = S.resolve(cfg.validation, cfg.include, cfg.exclude, cfg.text_field, kind="data.validation",
                             other_domains=None, chat_tokenizer=cfg.tokenizer)  # fmt: skip
    S.check_text_field(cfg.text_field, [d.name for d in [*domains, *vdomains]])
    clash = {d.name for d in domains} & {d.name for d in vdomains}
    if clash:
        raise S.DataError(
            f"data.validation: domain {sorted(clash)[0]!r} is also a training domain; name it apart (name=path)"
        )
    return domains, vdomains


def build_store(cfg: DataConfig, vocab_size: int, cache: Path | None = None, progress: bool = True,
                tokenizer_dir: Path | None = None) -> TokenStore:  # fmt: skip
    """Load the store for these inputs, building it first if there is none that is complete.
    ``tokenizer_dir``: a store whose tokenizer to use (evaluating a run on other data)."""

    domains, vdomains = resolve_all(cfg)
    ids = next((sh for d in domains + vdomains for sh in d.shards if sh.fmt == "tokens"), None)
    if ids is not None and not cfg.tokenizer and tokenizer_dir is None:
        raise S.DataError(
            f"{ids.path}: token ids are read with the tokenizer that made them; name it in data.tokenizer"
        )
    if tokenizer_dir is not None:
        tok_fp = "store:" + hashlib.sha256((Path(tokenizer_dir) / "tokenizer.json").read_bytes()).hexdigest()
    elif cfg.tokenizer:
        tok_fp = T.fingerprint(cfg.tokenizer)
    else:
        tok_fp = None
    key = store_key(cfg, vocab_size, domains, vdomains, tok_fp)
    root = Path(cache or S.cache_root())
    final = root / f"store-{key}"
    if (final / "manifest.json").exists():
        return open_store(final)
    root.mkdir(parents=True, exist_ok=True)
    build = root / f".build-store-{key}"
    # a corpus this small builds in a second or two: nothing to say while it does
    progress = progress and sum(s.size for d in domains + vdomains for s in d.shards) > QUIET_BYTES
    with _lock(root / f".build-store-{key}.lock", progress):
        if (final / "manifest.json").exists():
            return open_store(final)
        _clean_stale(root)
        tmp = root / f".tmp-store-{key}-{os.getpid()}"
        try:
            store = _build(cfg, vocab_size, domains, vdomains, key, build, tmp, final, progress, tokenizer_dir)
        except S.DataError:
            shutil.rmtree(build, ignore_errors=True)  # bad input: nothing is kept
            (root / f".build-store-{key}.lock").unlink(missing_ok=True)
            raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(build, ignore_errors=True)
        (root / f".build-store-{key}.lock").unlink(missing_ok=True)
        return store


def _tokenizer(cfg, vocab_size, domains, all_domains, tok_dir: Path, build: Path, progress, tokenizer_dir):
    """The store's tokenizer, saved in ``tok_dir`` (kept from an interrupted build): another store's,
    data.tokenizer, or a BPE trained on the training documents (with a chat template's markers where
    the domains hold conversations rendered by moelab's own)."""
    if (tok_dir / "tokenizer_moelab.json").exists():
        return T.load_saved(tok_dir)
    if tokenizer_dir is not None:
        tok = T.load_saved(tokenizer_dir)
    elif cfg.tokenizer:
        tok = T.load(cfg.tokenizer, vocab_size)
        say(f"tokenizer {cfg.tokenizer}: {tok.origin}", progress)
    else:
        say(
            f"training a {vocab_size}-token byte-level BPE tokenizer on up to {TOKENIZER_CHARS >> 20} MB of the "
            "training documents",
            progress,
        )
        chat = any(d.chat is not None and d.chat.origin == "moelab" for d in all_domains)
        tok = T.train(_tokenizer_texts(domains, cfg, S.Bad(skip=cfg.bad_records == "skip")), vocab_size,
                      SPECIAL_TOKENS if chat else ())  # fmt: skip
    staging = build / ".tokenizer"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    T.save(tok, staging)
    os.replace(staging, tok_dir)
    return tok


def _build(cfg, vocab_size, domains, vdomains, key, build: Path, tmp: Path, final: Path, progress, tokenizer_dir):
    t0 = time.time()
    all_domains = domains + vdomains
    tok_dir = build / "tokenizer"
    tok = _tokenizer(cfg, vocab_size, domains, all_domains, tok_dir, build, progress, tokenizer_dir)
    (build / "units").mkdir(parents=True, exist_ok=True)
    dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32
    units = plan_units(all_domains)
    workers = cfg.workers or len(os.sched_getaffinity(0)) or 1  # the cores this process may use
    done = _run_units(units, all_domains, build, tok_dir, dtype, cfg, workers, progress)
    if sum(len(d.shards) for d in all_domains) > 1:
        say(f"assembling the token store from {len(done)} units", progress)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    parts = _assemble(units, all_domains, len(domains), done, build, tmp, dtype, cfg)
    for name, files in parts["left_out"].items():
        say(f"{name}: left out {len(files)} files that are binary, not UTF-8 or not records "
            f"({', '.join(files[:3])}{', ...' if len(files) > 3 else ''})", progress)  # fmt: skip
    for dom in all_domains:
        if dom.left_out:
            say(f"{dom.name}: left out {len(dom.left_out)} files beside its records ({', '.join(dom.left_out[:3])}"
                f"{', ...' if len(dom.left_out) > 3 else ''})", progress)  # fmt: skip
    for name, shards in parts["bad"].items():
        n = sum(e["records"] for e in shards.values())
        say(f"{name}: data.bad_records=skip left out {n} records of {len(shards)} shards "
            f"(first: {next(iter(shards.values()))['why']})", progress)  # fmt: skip
    T.save(tok, tmp)
    np.save(tmp / "byte_lengths.npy", T.byte_lengths(tok))
    manifest = {
        "key": key,
        "version": STORE_VERSION,
        "sources": [{"spec": d.spec, "domain": d.name, "shards": len(d.shards)} for d in all_domains],
        "domains": [d.name for d in domains],
        "validation": [d.name for d in vdomains],
        "spans": parts["spans"],
        "stats": parts["stats"],
        "bad_records": parts["bad"],
        "left_out": {k: len(v) for k, v in parts["left_out"].items()},
        "units": [
            {"domain": all_domains[u.domain].name, "files": [all_domains[u.domain].shards[i].rel for i in u.shards]}
            for u in units
        ],  # fmt: skip
        "dtype": np.dtype(dtype).name,
        "n_tokens": parts["n_tokens"],
        "vocab_size": tok.vocab_size,
        "eot": tok.eos,
        "bos": tok.bos if tok.add_bos else None,
        "held_out_fraction": cfg.held_out_fraction,
    }
    if parts["mask"]:  # conversations: which tokens count in the loss (mask.bin)
        manifest["mask"] = True
        manifest["chat_template"] = next(d.chat.origin for d in all_domains if d.chat is not None)
    (tmp / "build.json").write_text(json.dumps({"seconds": round(time.time() - t0, 2), "workers": cfg.workers,
                                                 "backend": cfg.backend}))  # fmt: skip
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))  # last: marks the store complete
    try:
        os.rename(tmp, final)
    except OSError:  # another process finished the same store first
        shutil.rmtree(tmp, ignore_errors=True)
    return open_store(final)
