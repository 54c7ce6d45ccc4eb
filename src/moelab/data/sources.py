"""Data sources: each source is one or more domains of documents.

A source is a directory (every UTF-8 text file in it, recursively, whatever its name: the content
decides, binary files and other encodings are left out; hidden paths are skipped, and the globs
``data.include`` / ``data.exclude`` choose files), a ``.jsonl`` / ``.jsonl.gz`` file, a
``.parquet`` file, or a built-in corpus that every machine with Python and a C compiler has:
- ``stdlib``: the running interpreter's standard library, as three domains (library code, its
  test suite, and the prose of ``pydoc_data``);
- ``cheaders``: the C and C++ headers that ship with the system compiler, as three domains (the C
  library's, the Linux kernel's and the C++ standard library's), a second real corpus that is not
  Python, kept for checking that what works on ``stdlib`` carries over.
Bad input raises DataError with one line that names the file (and line).
"""

from __future__ import annotations

import codecs
import fnmatch
import gzip
import hashlib
import json
import os
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from moelab.errors import DataError  # noqa: F401 - raised here, importable from here

STDLIB_DOMAINS = ("stdlib-code", "stdlib-tests", "stdlib-docs")
CHEADERS_DOMAINS = ("cheaders-libc", "cheaders-linux", "cheaders-cxx")
BUILTIN = ("stdlib", "cheaders")
TEST_DIRS = {"test", "tests", "idle_test"}


@dataclass(frozen=True)
class Document:
    domain: str
    doc_id: str  # stable within its source: relative path, or path:line, or path#row
    text: str


@dataclass(frozen=True)
class Source:
    spec: str  # as the user wrote it
    kind: str  # stdlib | cheaders | dir | jsonl | parquet
    path: Path | None
    domains: tuple[str, ...]
    include: tuple[str, ...] = ()  # a directory's files: globs to keep (none: every file)
    exclude: tuple[str, ...] = ()  # ... and globs to leave out


def _domain_name(path: Path) -> str:
    name = path.name
    for suffix in (".jsonl.gz", ".jsonl", ".parquet"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def resolve(
    specs: tuple[str, ...] | list[str], include: tuple[str, ...] = (), exclude: tuple[str, ...] = ()
) -> list[Source]:
    """Check that every source exists and has a known form; name its domains (unique). ``include``
    and ``exclude`` (globs, ``data.include`` / ``data.exclude``) choose the files of directories."""
    out: list[Source] = []
    seen: set[str] = set()
    for spec in specs:
        if spec == "stdlib":
            src = Source(spec, "stdlib", stdlib_root(), STDLIB_DOMAINS)
        elif spec == "cheaders":
            root = cheaders_root()
            if not cheaders_files(root):
                raise DataError(
                    f"cheaders: no C headers under {root}; install the C compiler's headers (Debian: "
                    "libc6-dev, linux-libc-dev, libstdc++-dev) or name a directory of text instead"
                )
            src = Source(spec, "cheaders", root, CHEADERS_DOMAINS)
        else:
            path = Path(spec).expanduser()
            if not path.exists():
                raise DataError(f"{spec}: no such file or directory")
            if path.is_dir():
                kind = "dir"
            elif path.name.endswith((".jsonl", ".jsonl.gz")):
                kind = "jsonl"
            elif path.name.endswith(".parquet"):
                kind = "parquet"
            else:
                raise DataError(f"{spec}: not a directory, .jsonl, .jsonl.gz or .parquet file")
            globs = (tuple(include), tuple(exclude)) if kind == "dir" else ((), ())
            src = Source(spec, kind, path, (_domain_name(path.resolve()),), *globs)
        for d in src.domains:
            if d in seen:
                raise DataError(f"{spec}: domain {d!r} is already named by another source; rename one")
            seen.add(d)
        out.append(src)
    return out


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_files() -> list[tuple[str, Path]]:
    root = stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in ("site-packages", "dist-packages") or "__pycache__" in rel.parts:
            continue
        if rel.parts[0] == "pydoc_data":
            continue
        domain = "stdlib-tests" if TEST_DIRS.intersection(rel.parts[:-1]) else "stdlib-code"
        files.append((domain, path))
    return files


def _pydoc_topics() -> dict[str, str]:
    try:
        from pydoc_data.topics import topics  # prose of the language reference, in every CPython
    except ImportError:  # pragma: no cover - stripped Python builds
        return {}
    return dict(sorted(topics.items()))


def _iter_stdlib() -> Iterator[Document]:
    root = stdlib_root()
    for domain, path in _stdlib_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # the test suite ships files in other encodings on purpose
        yield Document(domain, str(path.relative_to(root)), text)
    for name, text in _pydoc_topics().items():
        yield Document("stdlib-docs", f"pydoc_data/topics/{name}", text)


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


def _iter_cheaders(src: Source) -> Iterator[Document]:
    assert src.path is not None
    for domain, path in cheaders_files(src.path):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a header in another encoding is left out, as the standard library's are
        yield Document(domain, str(path.relative_to(src.path)), text)


def _matches(rel: str, name: str, globs: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatch(rel, g) or fnmatch.fnmatch(name, g) for g in globs)


def _candidate_files(src: Source) -> list[Path]:
    """A directory's files, in order: not hidden (no part of the path starts with a dot), kept by
    ``include`` when it is given, not left out by ``exclude``."""
    assert src.path is not None
    out = []
    for p in sorted(src.path.rglob("*")):
        rel = p.relative_to(src.path)
        if any(part.startswith(".") for part in rel.parts) or not p.is_file():
            continue
        if src.include and not _matches(rel.as_posix(), p.name, src.include):
            continue
        if src.exclude and _matches(rel.as_posix(), p.name, src.exclude):
            continue
        out.append(p)
    return out


def _as_text(data: bytes) -> str | None:
    """The file's text when it is UTF-8 text: no NUL byte (binary) and valid UTF-8 throughout."""
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


MAX_PIECE_CHARS = 1 << 20  # a longer document is cut into pieces after a newline (moelab.data.store)
STREAM_BYTES = 16 << 20  # a file larger than this is read, decoded and cut as a stream, never whole


def _utf8_file(path: Path) -> bool:
    """Whether a file is UTF-8 text (no NUL in its first 8 KB, valid throughout), read in chunks."""
    dec = codecs.getincrementaldecoder("utf-8")()
    with open(path, "rb") as fh:
        head = True
        while chunk := fh.read(1 << 20):
            if head and b"\0" in chunk[:8192]:
                return False
            head = False
            try:
                dec.decode(chunk)
            except UnicodeDecodeError:
                return False
    try:
        dec.decode(b"", final=True)
    except UnicodeDecodeError:
        return False
    return True


def stream_pieces(path: Path, domain: str, doc_id: str, size: int) -> Iterator[Document]:
    """A large UTF-8 file as the pieces the store would cut it into (at most ``size`` characters,
    after the last newline in the second half of that span), holding about two pieces at a time."""
    dec = codecs.getincrementaldecoder("utf-8")()
    buf, k = "", 0
    with open(path, "rb") as fh:
        while True:
            chunk = fh.read(1 << 20)
            buf += dec.decode(chunk, final=not chunk)
            while len(buf) > size or (not chunk and buf):
                if len(buf) <= size:
                    piece, buf = buf, ""
                else:
                    nl = buf.rfind("\n", size // 2, size)
                    end = nl + 1 if nl != -1 else size
                    piece, buf = buf[:end], buf[end:]
                yield Document(domain, f"{doc_id}#{k}", piece)
                k += 1
            if not chunk:
                return


def _iter_dir(src: Source, skipped: list | None = None) -> Iterator[Document]:
    """Every UTF-8 text file of the directory, whatever its name (the content decides); files that
    are binary or in another encoding are left out (and listed in ``skipped``)."""
    assert src.path is not None
    files = _candidate_files(src)
    left_out = []
    found = 0
    for path in files:
        try:
            if path.stat().st_size > STREAM_BYTES:  # already in pieces, none held whole
                if not _utf8_file(path):
                    left_out.append(path)
                    continue
                found += 1
                yield from stream_pieces(path, src.domains[0], str(path.relative_to(src.path)), MAX_PIECE_CHARS)
                continue
            data = path.read_bytes()
        except OSError as exc:
            raise DataError(f"{path}: cannot be read ({exc.strerror or exc})") from None
        text = _as_text(data)
        del data  # not held while the document is read (a file can be hundreds of MB)
        if text is None:
            left_out.append(path)
            continue
        found += 1
        yield Document(src.domains[0], str(path.relative_to(src.path)), text)
    if skipped is not None:
        skipped.extend(left_out)
    if not found:
        globs = (f" include {list(src.include)}" if src.include else "") + (
            f" exclude {list(src.exclude)}" if src.exclude else ""
        )
        seen = ", ".join(p.name for p in left_out[:3]) + (", ..." if len(left_out) > 3 else "")
        raise DataError(
            f"{src.spec}: no UTF-8 text files among {len(files)} files{globs}"
            + (f" ({len(left_out)} binary or not UTF-8: {seen})" if left_out else "")
            + "; name a directory of text, or change data.include / data.exclude"
        )


def _iter_jsonl(src: Source, field: str) -> Iterator[Document]:
    assert src.path is not None
    opener = gzip.open if src.path.name.endswith(".gz") else open
    try:
        with opener(src.path, "rb") as fh:
            for lineno, raw in enumerate(fh, 1):
                if not raw.strip():
                    continue
                try:
                    obj = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
                    raise DataError(f"{src.path}:{lineno}: not valid JSON") from None
                if not isinstance(obj, dict) or field not in obj:
                    raise DataError(f"{src.path}:{lineno}: no {field!r} field (set data.text_field)")
                if not isinstance(obj[field], str):
                    raise DataError(f"{src.path}:{lineno}: field {field!r} is not a string")
                try:
                    obj[field].encode("utf-8")
                except UnicodeEncodeError:
                    raise DataError(f"{src.path}:{lineno}: field {field!r} holds a lone surrogate, not text") from None
                yield Document(src.domains[0], f"{src.path.name}:{lineno}", obj[field])
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"{src.path}: cannot be read ({type(exc).__name__}: {exc}); is it truncated?") from None


def _iter_parquet(src: Source, field: str) -> Iterator[Document]:
    assert src.path is not None
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(src.path, columns=[field])
    except (pa.ArrowInvalid, OSError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if field in msg and "No match for FieldRef" in msg:
            raise DataError(f"{src.path}: no column {field!r} (set data.text_field)") from None
        raise DataError(f"{src.path}: not a readable parquet file ({msg}); is it truncated?") from None
    column = table.column(0)
    if pa.types.is_dictionary(column.type):  # dictionary-encoded strings are still strings
        column = column.cast(column.type.value_type)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise DataError(f"{src.path}: column {field!r} is {column.type}, not text")
    for row, text in enumerate(column.to_pylist()):
        if text is not None:
            yield Document(src.domains[0], f"{src.path.name}#{row}", text)


def iter_documents(src: Source, text_field: str = "text", skipped: list | None = None) -> Iterator[Document]:
    if src.kind == "stdlib":
        yield from _iter_stdlib()
    elif src.kind == "cheaders":
        yield from _iter_cheaders(src)
    elif src.kind == "dir":
        yield from _iter_dir(src, skipped)
    elif src.kind == "jsonl":
        yield from _iter_jsonl(src, text_field)
    else:
        yield from _iter_parquet(src, text_field)


def fingerprint(src: Source) -> list:
    """What identifies a source's content without reading it: paths, sizes and mtimes."""
    if src.kind == "stdlib":
        files = [p for _, p in _stdlib_files()]
        import sys

        return [sys.version, len(files), sum(p.stat().st_size for p in files)]
    assert src.path is not None
    if src.kind == "cheaders":
        files = [p for _, p in cheaders_files(src.path)]
    else:
        files = _candidate_files(src) if src.kind == "dir" else [src.path]
    return [[str(p), (st := p.stat()).st_size, st.st_mtime_ns] for p in files]


def is_held_out(domain: str, doc_id: str, fraction: float) -> bool:
    """A document's split is a hash of its name: stable across runs, machines and file order."""
    digest = hashlib.sha256(f"{domain}\0{doc_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def cache_root() -> Path:
    return Path(os.environ.get("MOELAB_CACHE", ".moelab_cache"))
