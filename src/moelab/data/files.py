"""A source's files, local or through fsspec: listing, globbing, and each file's format and codec.

A path, folder or glob (``expand``) becomes shards: a folder is read as what it holds (a ``datasets``
``save_to_disk`` folder: its Arrow files; record files: those, the rest left out; else text), a file
by its suffixes and then its first bytes. Paths with a scheme go through fsspec, whose listings
also give each file's size and stamp (kept until the next ``clear_listings``).
"""

from __future__ import annotations

import fnmatch
import functools
import glob as globlib
import json
import os
import socket
from dataclasses import dataclass

from moelab.errors import DataError

CODECS = {".gz": "gz", ".zst": "zst", ".zstd": "zst", ".bz2": "bz2", ".xz": "xz"}
MAGIC = ((b"\x1f\x8b", "gz"), (b"\x28\xb5\x2f\xfd", "zst"), (b"BZh", "bz2"), (b"\xfd7zXZ\x00", "xz"))
RECORD_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".arrow": "arrow", ".feather": "arrow"}


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
    chat: object = None  # text_field "messages": the ChatTemplate its conversations are rendered with


def is_url(path: str) -> bool:
    return "://" in path


# the object stores' hosts, asked once before their filesystems' own retries (a minute of them, then a
# traceback, where the name does not resolve); an endpoint set in the environment is not checked
HOSTS = {
    "gs": "storage.googleapis.com",
    "gcs": "storage.googleapis.com",
    "s3": "s3.amazonaws.com",
    "hf": "huggingface.co",
}
ENDPOINT_ENV = {"gs": "STORAGE_EMULATOR_HOST", "gcs": "STORAGE_EMULATOR_HOST", "s3": "AWS_ENDPOINT_URL"}


@functools.cache
def _unreachable(protocol: str) -> str | None:
    """Why ``protocol``'s object store cannot be reached from here (its host's name does not resolve), or None."""
    host = HOSTS.get(protocol)
    if host is None or os.environ.get(ENDPOINT_ENV.get(protocol, "")):
        return None
    try:
        socket.getaddrinfo(host, 443)
    except OSError as exc:
        return f"cannot reach {host} ({exc.strerror or exc})"
    return None


def _fs(url: str):
    try:
        import fsspec
    except ImportError:
        raise DataError(f"{url}: a path with a scheme is read through fsspec; pip install 'moelab[remote]'") from None
    protocol = url.split("://", 1)[0]
    if why := _unreachable(protocol):
        raise DataError(f"{url}: {why}; check the address and this machine's network, or use a local copy")
    try:
        return fsspec.filesystem(protocol)
    except (ImportError, ValueError) as exc:
        raise DataError(f"{url}: no filesystem for {protocol}:// ({str(exc).splitlines()[0]})") from None


def open_raw(path: str):
    if is_url(path):
        return _fs(path).open(path, "rb")
    return open(path, "rb")


def _head(path: str, n: int = 16) -> bytes:
    try:
        with open_raw(path) as fh:
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
    if ext in RECORD_SUFFIXES and (codec or is_url(path)):  # named for what it is: no request for its first bytes
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


def clear_listings() -> None:
    """Forget remote files' details: the next listings fetch them afresh."""
    _INFO.clear()


def _stat(path: str) -> tuple[int, str]:
    if is_url(path):
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
    if is_url(root):
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
    return f"{root.rstrip('/')}/{rel}" if is_url(root) else os.path.join(root, rel)


def _isdir(path: str) -> bool:
    return _fs(path).isdir(path) if is_url(path) else os.path.isdir(path)


def exists(path: str) -> bool:
    return _fs(path).exists(path) if is_url(path) else os.path.exists(path)


def _datasets_files(folder: str, spec: str) -> tuple[list[str], str]:
    """The Arrow files of a ``datasets`` ``save_to_disk`` folder (a DatasetDict: its train split), and
    a note on what was chosen."""
    dd = _join(folder, "dataset_dict.json")
    note = ""
    if exists(dd):
        with open_raw(dd) as fh:
            splits = json.loads(fh.read()).get("splits", [])
        if "train" not in splits:
            raise DataError(f"{spec}: a DatasetDict without a train split (splits: {splits}); name a split's folder")
        note = f"its train split (others: {', '.join(s for s in splits if s != 'train') or 'none'})"
        folder = _join(folder, "train")
    with open_raw(_join(folder, "state.json")) as fh:
        state = json.loads(fh.read())
    files = [f["filename"] for f in state.get("_data_files", [])]
    if not files:
        raise DataError(f"{spec}: a datasets folder whose state.json lists no data files")
    return [_join(folder, f) for f in files], note


def _is_datasets(folder: str) -> bool:
    return exists(_join(folder, "dataset_dict.json")) or (
        exists(_join(folder, "state.json")) and exists(_join(folder, "dataset_info.json"))
    )


def _folder_shards(folder: str, spec: str, include, exclude, prefix: str = "") -> tuple[list[Shard], list[str]]:
    """A folder's shards (what it holds decides how it is read) and the files left out."""
    if _is_datasets(folder):
        files, _ = _datasets_files(folder, spec)
        shards = []
        for f in files:
            rel = (
                prefix + os.path.relpath(f, folder).replace(os.sep, "/")
                if not is_url(f)
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


def glob_base(pattern: str) -> str:
    parts = pattern.split("/")
    fixed = []
    for part in parts:
        if any(c in part for c in "*?["):
            break
        fixed.append(part)
    return "/".join(fixed) or "."


def expand(entry: str, spec: str, include, exclude) -> tuple[list[Shard], list[str]]:
    """A path, folder or glob as shards (sorted), and the files of its folders left out."""
    entry = os.path.expanduser(entry) if not is_url(entry) else entry
    if any(c in entry for c in "*?["):
        base = glob_base(entry)
        if is_url(entry):
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
    if not exists(entry):
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


def _file_shard(path: str, rel: str, fmt: str, codec: str) -> Shard:
    if rel.lower().endswith(".bin") and fmt == "text":
        fmt = "tokens"
    return Shard(path, rel, fmt, codec, True, *_stat(path))
