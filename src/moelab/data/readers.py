"""Reading one shard by its format, as a stream of documents: text, JSON lines, Parquet and Arrow,
each through its decompressor (gzip, zstd, bz2, xz). A domain whose text field is ``messages`` holds
conversations (``moelab.data.chat``): each is rendered by the domain's chat template, and its
document carries the assistant's characters.

Nothing is read whole: text past ``STREAM_BYTES`` is decoded in chunks and cut into pieces of at most
``MAX_PIECE_CHARS`` (the pieces ``sources.pieces`` cuts), JSON lines go line by line, Parquet by row
groups and Arrow by record batches. Bad input goes through ``Bad``: one line naming the shard (and
line or row), or, with ``data.bad_records: skip``, counted.
"""

from __future__ import annotations

import bz2
import codecs
import gzip
import io
import json
import lzma
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

from moelab.data.chat import problem
from moelab.data.files import Domain, Shard, is_url, open_raw
from moelab.errors import DataError, UsageError

MAX_PIECE_CHARS = 1 << 20  # a longer document is cut into pieces after a newline
STREAM_BYTES = 16 << 20  # a text file larger than this is read, decoded and cut as a stream, never whole


@dataclass(frozen=True)
class Document:
    domain: str
    doc_id: str  # stable within its domain: relative path, path#piece, path:line or path#row
    text: str
    row: int = 0  # the record's number in its shard (a line, a row, a piece)
    spans: tuple = ()  # a conversation's assistant characters, [start, end) pairs: its loss mask


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


class _Zstd(io.RawIOBase):
    """A zstd stream (one frame or several) as a readable file, decompressed chunk by chunk; a stream
    that ends inside a frame (a truncated file) raises EOFError. Not zstandard's own
    ``stream_reader(fh, read_across_frames=True)``: in zstandard 0.25.0 a file cut inside a frame
    reads there as its end, with no error (measured), so a truncated shard would pass as a short one."""

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
    raw = open_raw(shard.path)
    if shard.codec == "gz":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if shard.codec == "bz2":
        return bz2.BZ2File(raw, "rb")
    if shard.codec == "xz":
        return lzma.LZMAFile(raw, "rb")
    if shard.codec == "zst":
        return io.BufferedReader(_Zstd(raw), 1 << 20)
    return raw


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


def read_text(domain: Domain, shard: Shard, bad: Bad, left_out: list) -> Iterator[Document]:
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


def read_jsonl(domain: Domain, shard: Shard, bad: Bad) -> Iterator[Document]:
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
            if domain.chat is not None:
                if (
                    doc := conversation(domain, shard, bad, where, obj[f], f"{shard.rel}:{lineno}", lineno)
                ) is not None:
                    yield doc
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


def conversation(domain: Domain, shard: Shard, bad: Bad, where: str, messages, doc_id: str, row: int):
    """A record's conversation rendered by the domain's chat template, with the assistant's characters
    (``Document.spans``); None, through ``bad``, for one that is not a conversation or that the template
    refuses."""
    if (why := problem(messages)) is not None:
        bad.record(shard, where, why)
        return None
    try:
        text, spans = domain.chat.assistant_spans(messages)
    except UsageError as exc:
        bad.record(shard, where, str(exc))
        return None
    if len(text) > MAX_PIECE_CHARS:
        bad.record(shard, where, f"a conversation of {len(text)} characters, over {MAX_PIECE_CHARS}: split it")
        return None
    return Document(domain.name, doc_id, text, row, tuple(spans))


def _local_copy(shard: Shard, tmp_dir: str | None):
    """A seekable file for Parquet and Arrow: the path itself, or the shard decompressed (streamed)
    into a temporary file."""
    if not shard.codec:
        return shard.path if not is_url(shard.path) else None
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
            if domain.chat is not None:  # a column of conversations: lists of {"role", "content"}
                for messages in batch.column(index).to_pylist():
                    where = f"{shard.path}#row {row}"
                    if (
                        doc := conversation(domain, shard, bad, where, messages, f"{shard.rel}#{row}", row)
                    ) is not None:
                        yield doc
                    row += 1
                continue
            for text in _text_column(batch.column(index), shard, domain.text_field).to_pylist():
                if text is not None:
                    yield Document(domain.name, f"{shard.rel}#{row}", text, row)
                row += 1
    except (pa.ArrowInvalid, OSError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        bad.record(shard, f"{shard.path}#row {row}", f"cannot be read ({msg}); is it truncated?")


def read_parquet(domain: Domain, shard: Shard, bad: Bad, tmp_dir: str | None) -> Iterator[Document]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = domain.text_field
    local = _local_copy(shard, tmp_dir)
    try:
        try:
            # read, not memory-mapped: a mapped file's pages count in the process's memory as it is read
            pf = pq.ParquetFile(local if local else open_raw(shard.path), memory_map=False, pre_buffer=False)
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


def read_arrow(domain: Domain, shard: Shard, bad: Bad, tmp_dir: str | None) -> Iterator[Document]:
    import pyarrow as pa

    f = domain.text_field
    local = _local_copy(shard, tmp_dir)
    try:
        src = pa.OSFile(local) if local else open_raw(shard.path)  # one record batch at a time
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
