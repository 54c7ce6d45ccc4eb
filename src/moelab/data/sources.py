"""Data sources: a domain is a named set of shards, each read as a stream.

``data.sources`` is a list or a mapping:
- ``stdlib``: the running interpreter's standard library, as three domains (library code, its test
  suite, and the prose of ``pydoc_data``); ``cheaders``: the C and C++ headers of the system
  compiler, as three domains (the C library's, the Linux kernel's, the C++ standard library's);
- a path or a glob (``/data/fineweb/**/*.parquet``): one domain, named after the file or folder
  (the glob's fixed part); ``name=path-or-glob`` names it, and entries with one name make one domain;
- a mapping ``{web: [/data/fineweb/**/*.parquet, /more/*.jsonl.zst], code: [src/]}``: domain names
  to paths and globs, so one domain holds thousands of shards from many folders.

Each file is a shard, its format chosen by suffix and then content (magic bytes): plain text (one
document per file), JSON lines (``.jsonl``, ``.ndjson``, ``.json``; one record per line), Parquet, Arrow
(IPC file or stream, as ``datasets`` writes them), and token ids (``.npy``, or a ``.bin`` named as
such) with the tokenizer that made them; each optionally compressed (``.gz``, ``.zst``, ``.bz2``,
``.xz``). A folder is read as what it holds: a ``datasets`` ``save_to_disk`` folder is its Arrow
files (a DatasetDict: its ``train`` split); a folder with record files (JSON lines, Parquet, Arrow) is
those records, its other files (a README) left out and named; a folder without any is text, every
UTF-8 file in it whatever its name (binary files and other encodings are left out and named;
``data.include`` / ``data.exclude`` choose files). Hidden paths are skipped. Paths with a scheme
(``gs://``, ``s3://``, ``hf://``, ``memory://``) are read through fsspec (``pip install 'moelab[remote]'``).

Nothing is read whole: text files past ``STREAM_BYTES`` are decoded in chunks and cut into pieces,
JSON lines go line by line through the decompressor, Parquet by row groups and Arrow by record
batches. Bad input raises DataError with one line that names the shard (and line or row); with
``data.bad_records: skip`` the reader counts what it leaves out instead (``Bad``).

Here: resolving sources into domains, the built-in corpora, and a shard's documents; a source's
files and their formats are found in ``moelab.data.files``, each format is read in ``moelab.data.readers``.
"""

from __future__ import annotations

import hashlib
import lzma
import os
import re
import sysconfig
import zlib
from collections.abc import Iterator
from pathlib import Path

from moelab.cache import cache_root  # noqa: F401 - the store's folder is under it
from moelab.data.chat import ChatTemplate
from moelab.data.files import CODECS, RECORD_SUFFIXES, Domain, Shard, clear_listings, exists, expand, glob_base
from moelab.data.readers import (  # noqa: F401 - the readers' names, importable from here
    MAX_PIECE_CHARS,
    STREAM_BYTES,
    Bad,
    Document,
    open_shard,
    read_arrow,
    read_jsonl,
    read_parquet,
    read_text,
)
from moelab.errors import DataError  # noqa: F401 - raised here, importable from here

CHAT_FIELD = "messages"  # data.text_field naming conversations (moelab.data.chat)

STDLIB_DOMAINS = ("stdlib-code", "stdlib-tests", "stdlib-docs")
CHEADERS_DOMAINS = ("cheaders-libc", "cheaders-linux", "cheaders-cxx")
BUILTIN = ("stdlib", "cheaders")
TEST_DIRS = {"test", "tests", "idle_test"}
NAME = re.compile(r"^[A-Za-z0-9][\w.+-]*$")


# ---------------------------------------------------------------- resolving sources into domains


def astuple_rest(s: Shard) -> tuple:
    return (s.fmt, s.codec, s.strict, s.size, s.stamp)


def domain_name(path: str) -> str:
    """A domain's name from its path: the file name without its format and compression suffixes,
    or the folder's (a glob's fixed part's) name."""
    path = glob_base(path) if any(c in path for c in "*?[") else path
    name = path.rstrip("/").rsplit("/", 1)[-1] or "data"
    lower = name.lower()
    for _ in range(2):
        for suffix in list(CODECS) + list(RECORD_SUFFIXES) + [".json", ".npy", ".bin", ".txt"]:
            if lower.endswith(suffix) and len(lower) > len(suffix):
                name, lower = name[: -len(suffix)], lower[: -len(suffix)]
    return name


def _entries(sources) -> list[tuple[str | None, str, str]]:
    """(domain name or None, path, spec as written) of every entry, in order."""
    if isinstance(sources, dict):
        return [(str(k), str(p), f"{k}: {p}") for k, paths in sources.items() for p in paths]
    out = []
    for spec in sources:
        spec = str(spec)
        name, sep, rest = spec.partition("=")
        if sep and NAME.match(name) and rest and not exists(spec):
            out.append((name, rest, spec))
        else:
            out.append((None, spec, spec))
    return out


def resolve(
    sources,
    include=(),
    exclude=(),
    text_field: str | dict = "text",
    kind: str = "data.sources",
    other_domains: tuple[str, ...] | None = (),
    chat_tokenizer: str = "",
) -> list[Domain]:
    """Every domain with its shards, in order; every path checked now (a missing file, an empty glob,
    a folder with nothing to read: one line each). Domain names are unique. A domain whose text field
    is CHAT_FIELD holds conversations, rendered by the chat template of ``chat_tokenizer`` (the
    run's data.tokenizer; "": moelab's own)."""
    if isinstance(sources, str):
        sources = (sources,)
    clear_listings()  # remote details are as fresh as this resolve's listings
    domains: dict[str, dict] = {}
    order: list[str] = []

    def add(name: str, spec: str, shards, left=()):
        if name not in domains:
            domains[name] = {"spec": spec, "shards": [], "left": [], "entries": []}
            order.append(name)
        domains[name]["shards"] += shards
        domains[name]["left"] += list(left)
        domains[name]["entries"].append(spec)

    named: set[str] = set()
    for name, path, spec in _entries(sources):
        if not path.strip():
            raise DataError(
                f"{kind}: an empty source (an unset shell variable?); name a file, a folder, a glob or 'stdlib'"
            )
        if path in BUILTIN and name is None:
            for d in STDLIB_DOMAINS if path == "stdlib" else CHEADERS_DOMAINS:
                if d in domains:
                    raise DataError(f"{spec}: domain {d!r} is already named by another source; rename one")
            for d, shards in _builtin(path).items():
                add(d, spec, [(0, s) for s in shards])
            continue
        if path in BUILTIN:
            raise DataError(f"{spec}: {path} is several domains; list it on its own, without a name")
        if name is None:
            name = domain_name(path)
            if name in domains:
                raise DataError(f"{spec}: domain {name!r} is already named by another source; name it (name=path)")
        elif name in domains and name not in named:
            raise DataError(f"{spec}: domain {name!r} is already named by another source; rename one")
        named.add(name) if name is not None else None
        shards, left = expand(path, spec, tuple(include), tuple(exclude))
        k = len(domains[name]["entries"]) if name in domains else 0
        add(name, spec, [(k, s) for s in shards], left)
    out = []
    for name in order:
        seen, shards = set(), []
        for k, s in domains[name]["shards"]:  # a file named twice is read once
            if s.path not in seen:
                seen.add(s.path)
                shards.append((k, s))
        rels = [s.rel for _, s in shards]
        twice = {r for r in rels if rels.count(r) > 1} if len(set(rels)) < len(rels) else set()
        # equal names from two entries (two dumps' 000_00000.parquet) stay apart: the entry's number first
        shards = [Shard(s.path, f"{k}:{s.rel}", *astuple_rest(s)) if s.rel in twice else s for k, s in shards]
        field_ = text_field.get(name, "text") if isinstance(text_field, dict) else text_field
        chat = ChatTemplate.for_tokenizer(chat_tokenizer) if field_ == CHAT_FIELD else None
        out.append(Domain(name, domains[name]["spec"], tuple(shards), field_, tuple(domains[name]["left"]), chat))
    if other_domains is not None:  # None: the caller checks (training and validation share text_field)
        check_text_field(text_field, [*order, *other_domains])
    return out


def check_text_field(text_field: str | dict, domains: list[str]) -> None:
    """A per-domain data.text_field names only domains that exist."""
    if isinstance(text_field, dict):
        unknown = sorted(set(text_field) - set(domains))
        if unknown:
            raise DataError(f"data.text_field.{unknown[0]}: unknown domain (known: {', '.join(domains)})")


# ---------------------------------------------------------------- the built-in corpora


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_files() -> list[tuple[str, Path]]:
    root = stdlib_root()
    found = []
    # the folders left out are not walked (site-packages can hold more files than the stdlib: rglob
    # over it was a second of every run's start)
    for top, dirs, names in os.walk(root):
        skip = {"__pycache__"} | ({"site-packages", "dist-packages", "pydoc_data"} if top == str(root) else set())
        dirs[:] = [d for d in dirs if d not in skip]
        found += [Path(top) / n for n in names if n.endswith(".py")]
    files = []
    for path in sorted(found):
        rel = path.relative_to(root)
        domain = "stdlib-tests" if TEST_DIRS.intersection(rel.parts[:-1]) else "stdlib-code"
        files.append((domain, path))
    return files


def _pydoc_topics() -> dict[str, str]:
    try:
        from pydoc_data.topics import topics  # prose of the language reference, in every CPython
    except ImportError:  # pragma: no cover - stripped Python builds
        return {}
    return dict(sorted(topics.items()))


def cheaders_root() -> Path:
    return Path("/usr/include")


def cheaders_files(root: Path) -> list[tuple[str, Path]]:
    """(domain, path) of the compiler's headers, in a stable order: the C library's (``*.h`` at the
    top and the multiarch directory's, e.g. x86_64-linux-gnu/{bits,sys,gnu}), the kernel's (linux/,
    asm-generic/) and the newest C++ standard library's (c++/N/, its headers mostly without suffix)."""
    if not root.is_dir():
        return []
    out = [("cheaders-libc", p) for p in sorted(root.glob("*.h")) if p.is_file()]
    for arch in sorted(root.glob("*-linux-gnu*")):
        if arch.is_dir():
            out += [("cheaders-libc", p) for p in sorted(arch.rglob("*")) if p.is_file()
                    and not {"c++", "python"} & {x.split(".")[0].rstrip("0123456789") for x in p.relative_to(arch).parts[:-1]}]  # fmt: skip
    for sub in ("linux", "asm-generic"):
        out += [("cheaders-linux", p) for p in sorted((root / sub).rglob("*")) if p.is_file()]
    versions = sorted((p for p in (root / "c++").glob("*") if p.is_dir() and p.name.split(".")[0].isdigit()),
                      key=lambda p: [int(x) for x in p.name.split(".") if x.isdigit()])  # fmt: skip
    if versions:
        out += [("cheaders-cxx", p) for p in sorted(versions[-1].rglob("*")) if p.is_file()]
    return out


def _builtin(name: str) -> dict[str, list[Shard]]:
    """The built-in corpus's domains and their files (read by content: a file in another encoding
    is left out, as the standard library's test suite ships some on purpose)."""
    if name == "stdlib":
        root, files = stdlib_root(), _stdlib_files()
        out: dict[str, list[Shard]] = {d: [] for d in STDLIB_DOMAINS}
    else:
        root = cheaders_root()
        files = cheaders_files(root)
        if not files:
            raise DataError(
                f"cheaders: no C headers under {root}; install the C compiler's headers (Debian: "
                "libc6-dev, linux-libc-dev, libstdc++-dev) or name a directory of text instead"
            )
        out = {d: [] for d in CHEADERS_DOMAINS}
    for domain, path in files:
        st = path.stat()
        out[domain].append(
            Shard(str(path), str(path.relative_to(root)), "text", "", False, st.st_size, str(st.st_mtime_ns))
        )
    if name == "stdlib":
        import sys

        out["stdlib-docs"] = [Shard("pydoc_data.topics", "pydoc_data/topics", "pydoc", "", True, 0, sys.version)]
    return out


# ---------------------------------------------------------------- reading a shard


def pieces(doc: Document, size: int) -> Iterator[Document]:
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
        yield Document(doc.domain, f"{doc.doc_id}#{k}", text[start:end], doc.row)
        start, k = end, k + 1


def iter_shard(domain: Domain, shard: Shard, bad: Bad | None = None, left_out: list | None = None,
               tmp_dir: str | None = None) -> Iterator[Document]:  # fmt: skip
    """The shard's documents in order, as a stream. Text files that are binary or not UTF-8 in a
    folder read by content go to ``left_out``; every other bad input goes through ``bad``."""
    bad = bad or Bad()
    left_out = [] if left_out is None else left_out
    try:
        if shard.fmt == "pydoc":
            for k, (name, text) in enumerate(_pydoc_topics().items()):
                yield Document(domain.name, f"pydoc_data/topics/{name}", text, k)
        elif shard.fmt == "text":
            yield from read_text(domain, shard, bad, left_out)
        elif shard.fmt == "jsonl":
            yield from read_jsonl(domain, shard, bad)
        elif shard.fmt == "parquet":
            yield from read_parquet(domain, shard, bad, tmp_dir)
        elif shard.fmt == "arrow":
            yield from read_arrow(domain, shard, bad, tmp_dir)
        else:
            raise DataError(f"{shard.path}: token ids are read by the store (moelab.data.store), not as text")
    except (EOFError, zlib.error, lzma.LZMAError, OSError) as exc:
        bad.record(
            shard, shard.path, f"cannot be read ({type(exc).__name__}: {str(exc) or 'ends early'}); is it truncated?"
        )
    except Exception as exc:  # zstandard's errors
        if type(exc).__module__.startswith("zstandard") or "zstd" in type(exc).__name__.lower():
            bad.record(shard, shard.path, f"cannot be read (zstd: {exc}); is it truncated?")
        else:
            raise


def iter_documents(domain: Domain, bad: Bad | None = None, left_out: list | None = None) -> Iterator[Document]:
    """Every document of a domain, shard after shard (text shards only)."""
    for shard in domain.shards:
        if shard.fmt != "tokens":
            yield from iter_shard(domain, shard, bad, left_out)


def fingerprint(domain: Domain) -> list:
    """What identifies a domain's content without reading it: its shards' paths, sizes and stamps (and
    for conversations, the chat template that renders them)."""
    out = [domain.name, domain.text_field, [[s.path, s.fmt, s.codec, s.size, s.stamp] for s in domain.shards]]
    if domain.chat is not None:
        out.append(hashlib.sha256(domain.chat.source.encode()).hexdigest()[:16])
    return out


def doc_hash(domain: str, doc_id: str) -> int:
    digest = hashlib.sha256(f"{domain}\0{doc_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def is_held_out(domain: str, doc_id: str, fraction: float) -> bool:
    """A document's split is a hash of its name: stable across runs, machines, file order and workers."""
    return doc_hash(domain, doc_id) / 2**64 < fraction
