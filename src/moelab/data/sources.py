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
"""

from __future__ import annotations

import bz2
import codecs
import fnmatch
import glob as globlib
import gzip
import hashlib
import io
import json
import lzma
import os
import re
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from moelab.cache import cache_root  # noqa: F401 - the store's folder is under it
from moelab.errors import DataError  # noqa: F401 - raised here, importable from here

STDLIB_DOMAINS = ("stdlib-code", "stdlib-tests", "stdlib-docs")
CHEADERS_DOMAINS = ("cheaders-libc", "cheaders-linux", "cheaders-cxx")
BUILTIN = ("stdlib", "cheaders")
TEST_DIRS = {"test", "tests", "idle_test"}

CODECS = {".gz": "gz", ".zst": "zst", ".zstd": "zst", ".bz2": "bz2", ".xz": "xz"}
MAGIC = ((b"\x1f\x8b", "gz"), (b"\x28\xb5\x2f\xfd", "zst"), (b"BZh", "bz2"), (b"\xfd7zXZ\x00", "xz"))
RECORD_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".arrow": "arrow", ".feather": "arrow"}
MAX_PIECE_CHARS = 1 << 20  # a longer document is cut into pieces after a newline
STREAM_BYTES = 16 << 20  # a text file larger than this is read, decoded and cut as a stream, never whole
NAME = re.compile(r"^[A-Za-z0-9][\w.+-]*$")


@dataclass(frozen=True)
class Document:
    domain: str
    doc_id: str  # stable within its domain: relative path, path#piece, path:line or path#row
    text: str
    row: int = 0  # the record's number in its shard (a line, a row, a piece)


@dataclass(frozen=True)
class Shard:
    path: str  # a local path or a URL
    rel: str  # its name in document ids: relative to the folder or glob it came from
    fmt: str  # text | jsonl | parquet | arrow | tokens | pydoc
    codec: str = ""  # "" | gz | zst | bz2 | xz
    strict: bool = True  # text: a file that is not UTF-8 is bad input (False: left out, the content decides)
    size: int = 0
    stamp: str = ""  # mtime (or a remote file's etag): with the size, what identifies its content


@dataclass(frozen=True)
class Domain:
    name: str
    spec: str  # as the user wrote it (for messages)
    shards: tuple[Shard, ...]
    text_field: str = "text"
    left_out: tuple[str, ...] = ()  # files of its folders that are not read (a README beside parquet shards)


@dataclass
class Bad:
    """What ``data.bad_records: skip`` leaves out, per shard: {rel: {"records": n, "why": first reason}}."""

    skip: bool = False
    shards: dict = field(default_factory=dict)

    def record(self, shard: Shard, where: str, why: str, n: int = 1) -> None:
        if not self.skip:
            raise DataError(f"{where}: {why}")
        entry = self.shards.setdefault(shard.rel, {"records": 0, "why": f"{where}: {why}"})
        entry["records"] += n


# ---------------------------------------------------------------- files, local or through fsspec


def _is_url(path: str) -> bool:
    return "://" in path


def _fs(url: str):
    try:
        import fsspec
    except ImportError:
        raise DataError(f"{url}: a path with a scheme is read through fsspec; pip install 'moelab[remote]'") from None
    protocol = url.split("://", 1)[0]
    try:
        return fsspec.filesystem(protocol)
    except (ImportError, ValueError) as exc:
        raise DataError(f"{url}: no filesystem for {protocol}:// ({str(exc).splitlines()[0]})") from None


def _open_raw(path: str):
    if _is_url(path):
        return _fs(path).open(path, "rb")
    return open(path, "rb")


class _Zstd(io.RawIOBase):
    """A zstd stream (one frame or several) as a readable file, decompressed chunk by chunk; a stream
    that ends inside a frame (a truncated file) raises EOFError."""

    def __init__(self, fh):
        import zstandard

        self._fh, self._dctx = fh, zstandard.ZstdDecompressor()
        self._obj = self._dctx.decompressobj()
        self._buf, self._pos, self._in_frame = b"", 0, False

    def readable(self) -> bool:
        return True

    def _fill(self) -> bool:
        chunk = self._fh.read(1 << 20)
        if not chunk:
            if self._in_frame:
                raise EOFError("the zstd stream ends inside a frame")
            return False
        out = []
        while chunk:
            out.append(self._obj.decompress(chunk))
            self._in_frame = True
            if self._obj.eof:
                chunk = self._obj.unused_data
                self._obj, self._in_frame = self._dctx.decompressobj(), False
            else:
                chunk = b""
        self._buf, self._pos = self._buf[self._pos :] + b"".join(out), 0
        return True

    def readinto(self, b) -> int:
        while self._pos >= len(self._buf):
            if not self._fill():
                return 0
        n = min(len(b), len(self._buf) - self._pos)
        b[:n] = self._buf[self._pos : self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        self._fh.close()
        super().close()


def open_shard(shard: Shard):
    """The shard's bytes as a stream, decompressed."""
    raw = _open_raw(shard.path)
    if shard.codec == "gz":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if shard.codec == "bz2":
        return bz2.BZ2File(raw, "rb")
    if shard.codec == "xz":
        return lzma.LZMAFile(raw, "rb")
    if shard.codec == "zst":
        return io.BufferedReader(_Zstd(raw), 1 << 20)
    return raw


def _head(path: str, n: int = 16) -> bytes:
    try:
        with _open_raw(path) as fh:
            return fh.read(n)
    except OSError:
        return b""


def _classify(path: str, name: str, head: bytes | None = None) -> tuple[str, str]:
    """(format, codec) of a file from its suffixes, then its first bytes: format is one of jsonl,
    parquet, arrow, tokens, text, or "" (a ``.json`` whose kind its folder decides)."""
    lower = name.lower()
    stem, ext = os.path.splitext(lower)
    codec = CODECS.get(ext, "")
    if codec:
        lower, ext = stem, os.path.splitext(stem)[1]
    if ext in RECORD_SUFFIXES and (codec or _is_url(path)):  # named for what it is: no request for its first bytes
        return RECORD_SUFFIXES[ext], codec
    head = _head(path) if head is None else head
    if not codec:
        codec = next((c for magic, c in MAGIC if head.startswith(magic)), "")
    if ext in RECORD_SUFFIXES:
        return RECORD_SUFFIXES[ext], codec
    if ext == ".json":  # JSON lines when compressed or when its first line is a whole object; else its folder decides
        return ("jsonl" if codec or _object_line(path) else ""), codec
    if ext == ".npy" and not codec:
        return "tokens", codec
    if head.startswith(b"PAR1"):
        return "parquet", codec
    if head.startswith(b"ARROW1") or head.startswith(b"\xff\xff\xff\xff"):
        return "arrow", codec
    return "text", codec


def _object_line(path: str) -> bool:
    """Whether a file's first line is a whole JSON object (JSON lines; a package.json opens with "{")."""
    line = _head(path, 1 << 16).split(b"\n", 1)[0].removeprefix(b"\xef\xbb\xbf")
    try:
        return isinstance(json.loads(line), dict)
    except (ValueError, RecursionError):
        return False


_INFO: dict[str, dict] = {}  # remote files' details from the listings that found them


def _stat(path: str) -> tuple[int, str]:
    if _is_url(path):
        info = _INFO.get(path) or _fs(path).info(path)
        stamp = (
            info.get("ETag")
            or info.get("etag")
            or info.get("md5Hash")
            or info.get("mtime")
            or info.get("LastModified")
            or info.get("created")
            or ""
        )
        return int(info.get("size") or 0), str(stamp)
    st = os.stat(path)
    return st.st_size, str(st.st_mtime_ns)


def _hidden(rel: str) -> bool:
    return any(part.startswith(".") for part in rel.split("/") if part not in ("", "."))


def _matches(rel: str, name: str, globs: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatch(rel, g) or fnmatch.fnmatch(name, g) for g in globs)


def _bare(path: str) -> str:
    """A path without its scheme and leading slashes (fsspec's listings drop or keep them by filesystem)."""
    return path.split("://", 1)[-1].lstrip("/")


def _walk(root: str) -> list[str]:
    """Every file under a folder, sorted, as paths relative to it."""
    if _is_url(root):
        base = _bare(root).rstrip("/")
        proto = root.split("://", 1)[0] + "://"
        found = _fs(root).find(root, detail=True)  # one listing, sizes and stamps included
        _INFO.update({proto + _bare(p): info for p, info in found.items()})
        return sorted(_bare(p)[len(base) :].lstrip("/") for p in found if _bare(p).startswith(base))
    out = []
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        rel_dir = os.path.relpath(dirpath, root)
        for f in files:
            out.append(f if rel_dir == "." else f"{rel_dir}/{f}".replace(os.sep, "/"))
    return sorted(out)


def _join(root: str, rel: str) -> str:
    return f"{root.rstrip('/')}/{rel}" if _is_url(root) else os.path.join(root, rel)


def _isdir(path: str) -> bool:
    return _fs(path).isdir(path) if _is_url(path) else os.path.isdir(path)


def _exists(path: str) -> bool:
    return _fs(path).exists(path) if _is_url(path) else os.path.exists(path)


# ---------------------------------------------------------------- resolving sources into domains


def _datasets_files(folder: str, spec: str) -> tuple[list[str], str]:
    """The Arrow files of a ``datasets`` ``save_to_disk`` folder (a DatasetDict: its train split), and
    a note on what was chosen."""
    dd = _join(folder, "dataset_dict.json")
    note = ""
    if _exists(dd):
        with _open_raw(dd) as fh:
            splits = json.loads(fh.read()).get("splits", [])
        if "train" not in splits:
            raise DataError(f"{spec}: a DatasetDict without a train split (splits: {splits}); name a split's folder")
        note = f"its train split (others: {', '.join(s for s in splits if s != 'train') or 'none'})"
        folder = _join(folder, "train")
    with _open_raw(_join(folder, "state.json")) as fh:
        state = json.loads(fh.read())
    files = [f["filename"] for f in state.get("_data_files", [])]
    if not files:
        raise DataError(f"{spec}: a datasets folder whose state.json lists no data files")
    return [_join(folder, f) for f in files], note


def _is_datasets(folder: str) -> bool:
    return _exists(_join(folder, "dataset_dict.json")) or (
        _exists(_join(folder, "state.json")) and _exists(_join(folder, "dataset_info.json"))
    )


def _folder_shards(folder: str, spec: str, include, exclude, prefix: str = "") -> tuple[list[Shard], list[str]]:
    """A folder's shards (what it holds decides how it is read) and the files left out."""
    if _is_datasets(folder):
        files, _ = _datasets_files(folder, spec)
        shards = []
        for f in files:
            rel = (
                prefix + os.path.relpath(f, folder).replace(os.sep, "/")
                if not _is_url(f)
                else prefix + f[len(folder) :].lstrip("/")
            )
            shards.append(Shard(f, rel, "arrow", "", True, *_stat(f)))
        return shards, []
    rels = [r for r in _walk(folder) if not _hidden(r)]
    if include:
        rels = [r for r in rels if _matches(r, r.rsplit("/", 1)[-1], include)]
    if exclude:
        rels = [r for r in rels if not _matches(r, r.rsplit("/", 1)[-1], exclude)]
    kinds = {r: _classify(_join(folder, r), r.rsplit("/", 1)[-1]) for r in rels}
    records = any(fmt in ("jsonl", "parquet", "arrow") for fmt, _ in kinds.values())
    shards, left = [], []
    for r in rels:
        fmt, codec = kinds[r]
        if fmt == "":
            fmt = "jsonl" if records else "text"
        if records and fmt in ("text", "tokens"):
            left.append(r)
            continue
        if not records and fmt == "tokens":
            left.append(r)
            continue
        path = _join(folder, r)
        shards.append(Shard(path, prefix + r, fmt, codec, fmt != "text", *_stat(path)))
    return shards, left


def _glob_base(pattern: str) -> str:
    parts = pattern.split("/")
    fixed = []
    for part in parts:
        if any(c in part for c in "*?["):
            break
        fixed.append(part)
    return "/".join(fixed) or "."


def _expand(entry: str, spec: str, include, exclude) -> tuple[list[Shard], list[str]]:
    """A path, folder or glob as shards (sorted), and the files of its folders left out."""
    entry = os.path.expanduser(entry) if not _is_url(entry) else entry
    if any(c in entry for c in "*?["):
        base = _glob_base(entry)
        if _is_url(entry):
            proto = entry.split("://", 1)[0] + "://"
            listing = _fs(entry).glob(entry, detail=True)  # one listing, sizes and stamps included
            _INFO.update({proto + _bare(p): info for p, info in listing.items()})
            found = sorted(proto + _bare(p) for p, info in listing.items() if info.get("type") != "directory")
        else:
            found = sorted(globlib.glob(entry, recursive=True))
        shards, left = [], []
        for p in found:
            rel = _bare(p)[len(_bare(base)) :].lstrip("/") if _bare(p).startswith(_bare(base)) else os.path.basename(p)
            if _hidden(rel):
                continue
            if _isdir(p):
                s, lo = _folder_shards(p, spec, include, exclude, prefix=rel + "/")
                shards += s
                left += lo
                continue
            fmt, codec = _classify(p, p.rsplit("/", 1)[-1])
            shards.append(_file_shard(p, rel, fmt or "jsonl", codec))
        if not shards:
            raise DataError(f"{spec}: the glob {entry!r} matches no files")
        return shards, left
    if not _exists(entry):
        raise DataError(f"{spec}: no such file or directory")
    if _isdir(entry):
        shards, left = _folder_shards(entry, spec, include, exclude)
        if not shards:
            what = (
                f" ({len(left)} files of other kinds: {', '.join(left[:3])}{', ...' if len(left) > 3 else ''})"
                if left
                else ""
            )
            globs = (f" include {list(include)}" if include else "") + (f" exclude {list(exclude)}" if exclude else "")
            raise DataError(
                f"{spec}: no files to read among {len(left)} files{globs}{what}; name a folder of text or records"
            )
        return shards, left
    name = entry.rsplit("/", 1)[-1]
    fmt, codec = _classify(entry, name)
    if name.lower().endswith(".bin"):
        fmt = "tokens"
    return [_file_shard(entry, name, fmt or "jsonl", codec)], []


def astuple_rest(s: Shard) -> tuple:
    return (s.fmt, s.codec, s.strict, s.size, s.stamp)


def _file_shard(path: str, rel: str, fmt: str, codec: str) -> Shard:
    if rel.lower().endswith(".bin") and fmt == "text":
        fmt = "tokens"
    return Shard(path, rel, fmt, codec, True, *_stat(path))


def domain_name(path: str) -> str:
    """A domain's name from its path: the file name without its format and compression suffixes,
    or the folder's (a glob's fixed part's) name."""
    path = _glob_base(path) if any(c in path for c in "*?[") else path
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
        if sep and NAME.match(name) and rest and not _exists(spec):
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
) -> list[Domain]:
    """Every domain with its shards, in order; every path checked now (a missing file, an empty glob,
    a folder with nothing to read: one line each). Domain names are unique."""
    if isinstance(sources, str):
        sources = (sources,)
    _INFO.clear()  # remote details are as fresh as this resolve's listings
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
        shards, left = _expand(path, spec, tuple(include), tuple(exclude))
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
        out.append(Domain(name, domains[name]["spec"], tuple(shards), field_, tuple(domains[name]["left"])))
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


def _text_piece_ids(fh, domain: str, rel: str, size: int, head: bytes) -> Iterator[Document]:
    """A large UTF-8 stream as pieces of at most ``size`` characters, cut after the last newline in
    the second half of that span, holding about two pieces at a time."""
    dec = codecs.getincrementaldecoder("utf-8")()
    buf, k = "", 0
    chunk = head
    while True:
        buf += dec.decode(chunk, final=not chunk)
        while len(buf) > size or (not chunk and buf):
            if len(buf) <= size:
                piece, buf = buf, ""
            else:
                nl = buf.rfind("\n", size // 2, size)
                end = nl + 1 if nl != -1 else size
                piece, buf = buf[:end], buf[end:]
            yield Document(domain, f"{rel}#{k}", piece, k)
            k += 1
        if not chunk:
            return
        chunk = fh.read(1 << 20)


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


def _read_text(domain: Domain, shard: Shard, bad: Bad, left_out: list) -> Iterator[Document]:
    with open_shard(shard) as fh:
        head = fh.read(STREAM_BYTES + 1)
        if b"\0" in head[:8192]:
            if shard.strict:
                bad.record(shard, shard.path, "binary, not text (a NUL byte in its first 8 KB)")
            else:
                left_out.append(shard.rel)
            return
        if len(head) <= STREAM_BYTES:
            try:
                text = head.decode("utf-8")
            except UnicodeDecodeError as exc:
                if shard.strict:
                    bad.record(shard, shard.path, f"not UTF-8 text (byte {exc.start})")
                else:
                    left_out.append(shard.rel)
                return
            del head
            yield Document(domain.name, shard.rel, text)
            return
    # a large file is checked whole (a pass in chunks) before any piece of it is used
    with open_shard(shard) as check:
        ok = _utf8_stream(check)
    if not ok:
        if shard.strict:
            bad.record(shard, shard.path, "not UTF-8 text")
        else:
            left_out.append(shard.rel)
        return
    with open_shard(shard) as fh:
        yield from _text_piece_ids(fh, domain.name, shard.rel, MAX_PIECE_CHARS, fh.read(1 << 20))


def _utf8_stream(fh) -> bool:
    dec = codecs.getincrementaldecoder("utf-8")()
    try:
        while chunk := fh.read(1 << 20):
            dec.decode(chunk)
        dec.decode(b"", final=True)
    except UnicodeDecodeError:
        return False
    return True


def _read_jsonl(domain: Domain, shard: Shard, bad: Bad) -> Iterator[Document]:
    f = domain.text_field
    with open_shard(shard) as fh:
        for lineno, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            where = f"{shard.path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                bad.record(shard, where, "not UTF-8 text")
                continue
            if lineno == 1:
                line = line.removeprefix("\ufeff")  # a byte-order mark
            try:
                obj = json.loads(line)
            except (json.JSONDecodeError, RecursionError):
                if lineno == 1 and line.lstrip().startswith("["):
                    raise DataError(
                        f"{where}: a JSON array, not JSON lines (one object per line); convert it"
                    ) from None
                bad.record(shard, where, "not valid JSON")
                continue
            if lineno == 1 and isinstance(obj, list):
                raise DataError(f"{where}: a JSON array, not JSON lines (one object per line); convert it")
            if not isinstance(obj, dict) or f not in obj:
                bad.record(shard, where, f"no {f!r} field (set data.text_field)")
                continue
            text = obj[f]
            if text is None:
                continue
            if not isinstance(text, str):
                bad.record(shard, where, f"field {f!r} is not a string")
                continue
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                bad.record(shard, where, f"field {f!r} holds a lone surrogate, not text")
                continue
            yield Document(domain.name, f"{shard.rel}:{lineno}", text, lineno)


def _local_copy(shard: Shard, tmp_dir: str | None):
    """A seekable file for Parquet and Arrow: the path itself, or the shard decompressed (streamed)
    into a temporary file."""
    if not shard.codec:
        return shard.path if not _is_url(shard.path) else None
    import shutil
    import tempfile

    fd, tmp = tempfile.mkstemp(prefix=".shard-", dir=tmp_dir)
    with os.fdopen(fd, "wb") as out, open_shard(shard) as fh:
        shutil.copyfileobj(fh, out, 1 << 20)
    return tmp


def _text_column(col, shard: Shard, f: str):
    import pyarrow as pa

    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type) or pa.types.is_string_view(col.type)):
        raise DataError(f"{shard.path}: column {f!r} is {col.type}, not text")
    return col


def _batch_rows(domain: Domain, shard: Shard, bad: Bad, batches, index: int) -> Iterator[Document]:
    """The documents of a stream of record batches (Parquet's row groups, Arrow's batches), column
    ``index`` the text; a batch that cannot be read ends the shard through ``bad``."""
    import pyarrow as pa

    row = 0
    try:
        for batch in batches:
            for text in _text_column(batch.column(index), shard, domain.text_field).to_pylist():
                if text is not None:
                    yield Document(domain.name, f"{shard.rel}#{row}", text, row)
                row += 1
    except (pa.ArrowInvalid, OSError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        bad.record(shard, f"{shard.path}#row {row}", f"cannot be read ({msg}); is it truncated?")


def _read_parquet(domain: Domain, shard: Shard, bad: Bad, tmp_dir: str | None) -> Iterator[Document]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = domain.text_field
    local = _local_copy(shard, tmp_dir)
    try:
        try:
            # read, not memory-mapped: a mapped file's pages count in the process's memory as it is read
            pf = pq.ParquetFile(local if local else _open_raw(shard.path), memory_map=False, pre_buffer=False)
        except (pa.ArrowInvalid, OSError) as exc:
            msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            bad.record(shard, shard.path, f"not a readable parquet file ({msg}); is it truncated?")
            return
        names = pf.schema_arrow.names
        if f not in names:
            bad.record(
                shard,
                shard.path,
                f"no column {f!r} (columns: {', '.join(names[:8])}; set data.text_field)",
                pf.metadata.num_rows,
            )
            return
        yield from _batch_rows(domain, shard, bad, pf.iter_batches(batch_size=2048, columns=[f]), 0)
    finally:
        if local and local != shard.path:
            os.unlink(local)


def _read_arrow(domain: Domain, shard: Shard, bad: Bad, tmp_dir: str | None) -> Iterator[Document]:
    import pyarrow as pa

    f = domain.text_field
    local = _local_copy(shard, tmp_dir)
    try:
        src = pa.OSFile(local) if local else _open_raw(shard.path)  # one record batch at a time
        try:
            try:
                reader = pa.ipc.open_file(src)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
                schema = reader.schema
            except pa.ArrowInvalid:
                src.seek(0)
                reader = pa.ipc.open_stream(src)
                batches, schema = iter(reader), reader.schema
        except (pa.ArrowInvalid, OSError) as exc:
            msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            bad.record(shard, shard.path, f"not a readable Arrow file ({msg}); is it truncated?")
            return
        if f not in schema.names:
            bad.record(
                shard, shard.path, f"no column {f!r} (columns: {', '.join(schema.names[:8])}; set data.text_field)"
            )
            return
        yield from _batch_rows(domain, shard, bad, batches, schema.get_field_index(f))
    finally:
        if local and local != shard.path:
            os.unlink(local)


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
            yield from _read_text(domain, shard, bad, left_out)
        elif shard.fmt == "jsonl":
            yield from _read_jsonl(domain, shard, bad)
        elif shard.fmt == "parquet":
            yield from _read_parquet(domain, shard, bad, tmp_dir)
        elif shard.fmt == "arrow":
            yield from _read_arrow(domain, shard, bad, tmp_dir)
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
    """What identifies a domain's content without reading it: its shards' paths, sizes and stamps."""
    return [domain.name, domain.text_field, [[s.path, s.fmt, s.codec, s.size, s.stamp] for s in domain.shards]]


def doc_hash(domain: str, doc_id: str) -> int:
    digest = hashlib.sha256(f"{domain}\0{doc_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def is_held_out(domain: str, doc_id: str, fraction: float) -> bool:
    """A document's split is a hash of its name: stable across runs, machines, file order and workers."""
    return doc_hash(domain, doc_id) / 2**64 < fraction
