"""Reading corpora through fsspec: UTF-8 text, JSON lines (plain, .gz, .zst) and Parquet, cut into
units that workers read and tokenize on their own.
The default corpus (tiny Shakespeare) is fetched once per node when it is missing."""

from __future__ import annotations

import json
import logging
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import fsspec

from mingpt.runtime.storage import atomic_write_bytes, file_lock, is_local

log = logging.getLogger(__name__)

TINY_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
DEFAULT_CORPUS = "data/input.txt"


class DataError(RuntimeError):
    """A corpus cannot be read or prepared; the message says how to fix it."""


def _fetch_tiny_shakespeare() -> bytes:
    with urllib.request.urlopen(TINY_SHAKESPEARE_URL, timeout=15) as resp:
        return resp.read()


def ensure_default_corpus(path: str) -> str:
    """Make sure the default local corpus exists; returns the path to read.

    Downloads tiny Shakespeare from its public address once (one process per node, under a lock).
    Without internet it stops with the reason and the command that supplies the file by hand: a
    training job installs nothing and never trains on another corpus than the one asked for.
    """
    target = Path(path)
    with file_lock(target.with_name(f".{target.name}.lock")):
        if target.exists():
            return str(target)
        try:
            log.info("corpus %s is missing; downloading tiny Shakespeare from %s", target, TINY_SHAKESPEARE_URL)
            atomic_write_bytes(target, _fetch_tiny_shakespeare())
        except Exception as e:  # noqa: BLE001 - any failure of the download: the user supplies the file
            reason = getattr(e, "reason", None) or e
            raise DataError(
                f"corpus {path} is missing and tiny Shakespeare could not be downloaded ({e.__class__.__name__}: "
                f"{reason}). Without internet, copy it there from a machine that has it (`curl -o {path} "
                f"{TINY_SHAKESPEARE_URL}`), or set data.path to your own UTF-8 text file (data/README.md)"
            ) from None
        log.info("corpus: tiny Shakespeare, saved to %s", target)
        return str(target)


def locate_corpus(path: str, fetch_default: bool) -> str:
    """The path to read: `path` itself, or the default corpus, fetched when it is missing."""
    if is_local(path) and not Path(path).exists():
        # Only the default corpus is fetched: a missing file of the user's own is an error.
        if not (fetch_default and Path(path) == Path(DEFAULT_CORPUS)):
            raise DataError(f"corpus file {path} does not exist; set data.path to a UTF-8 text file "
                            f"(see data/README.md), or leave data.path={DEFAULT_CORPUS} to fetch tiny Shakespeare")
        path = ensure_default_corpus(path)
    return path


def read_text(path: str) -> str:
    """One UTF-8 text file (local or any fsspec URL), or one clear error."""
    try:
        with fsspec.open(path, "rb") as fh:
            raw = fh.read()
    except FileNotFoundError:
        raise DataError(f"corpus {path} does not exist; check data.path") from None
    except Exception as e:  # noqa: BLE001 - network/permission errors of any fsspec backend
        raise DataError(f"cannot read corpus {path}: {e.__class__.__name__}: {e}") from None
    text = _decode(raw, path, 0)
    if not text:
        raise DataError(f"corpus {path} is empty")
    return text


def document_files(path: str, fmt: str, fetch_default: bool) -> list[str]:
    """The files a raw corpus is read from: one text or JSON-lines file, or those of a directory /
    glob (sorted)."""
    if fmt in ("text", "jsonl"):
        path = locate_corpus(path, fetch_default and fmt == "text")
        return [path] if is_local(path) else expand_inputs([path])[:1]  # a remote one: reachable, and there
    if fmt != "files":
        raise DataError(f"data.documents.format={fmt!r}: use text, jsonl or files")
    return expand_inputs([path])


def _url(fs, path: str) -> str:
    proto = fs.protocol[0] if isinstance(fs.protocol, tuple) else fs.protocol
    return path if proto in ("file", "local") else f"{proto}://{path}"


def unreachable(what: str, e: Exception) -> DataError:
    return DataError(f"cannot reach {what} ({e.__class__.__name__}: {e}); check the path, and for s3:// the "
                     "endpoint (AWS_ENDPOINT_URL) and the AWS credentials in the environment")


def expand_inputs(inputs: list[str]) -> list[str]:
    """Every file the inputs name: files, directories (every file below, sorted, hidden ones left
    out) and globs, local or any fsspec URL."""
    files = []
    for item in inputs:
        try:
            fs, root = fsspec.core.url_to_fs(item)
            if any(c in root for c in "*?["):
                found = sorted(f for f in fs.glob(root) if fs.isfile(f))
            else:
                try:
                    kind = fs.info(root)["type"]
                except FileNotFoundError:
                    raise DataError(_missing(fs, item, root)) from None
                found = [root] if kind != "directory" else sorted(
                    f for f in fs.find(root) if not any(p.startswith(".") for p in f[len(root):].split("/")))
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001 - any backend's connection or permission error
            raise unreachable(item, e) from None
        if not found:
            raise DataError(f"no files match {item}; name files, directories or globs of text, .jsonl or .parquet")
        files.extend(_url(fs, f) for f in found)
    return files


def _missing(fs, item: str, root: str) -> str:
    """What is missing: the input, or on S3 its whole bucket (s3fs says "Not Found" for both)."""
    bucket = root.split("/", 1)[0]
    if "s3" in fs.protocol and not fs.exists(bucket):
        return (f"bucket {bucket} of input {item} does not exist or is not reachable at {fs.s3.meta.endpoint_url}: "
                "correct the path, or the endpoint (AWS_ENDPOINT_URL)")
    return f"input {item} does not exist; check the path"


JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonl.gz", ".jsonl.zst", ".ndjson.gz", ".ndjson.zst")


def input_format(path: str, fmt: str) -> str:
    """text, jsonl or parquet: `fmt`, or for fmt=auto the file's extension."""
    if fmt != "auto":
        return fmt
    name = path.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    return "parquet" if name.endswith((".parquet", ".pq")) else "text"


@dataclass(frozen=True)
class Unit:
    """One piece of preparation work, read and tokenized on its own: a byte range of an
    uncompressed text or JSON-lines file (cut where the pieces give the same tokens as the
    whole), a whole compressed or separator-split file, or one row group of a Parquet file.

    part/parts: this unit's number among its file's units; begin/end: the nominal byte range
    (the real cuts are found by the worker) or the row group.
    """

    path: str
    fmt: str
    part: int
    parts: int
    begin: int
    end: int
    size: int  # the file's bytes, for progress and the manifest


def work_bytes(unit: Unit) -> int:
    """A unit's share of its file's bytes (for progress and throughput)."""
    return unit.end - unit.begin if unit.fmt != "parquet" else unit.size // unit.parts


def file_units(path: str, fmt: str, separator: str | None, unit_bytes: int, text_field: str) -> list[Unit]:
    """The units of one input file (see Unit)."""
    try:
        fs, key = fsspec.core.url_to_fs(path)
        size = int(fs.info(key)["size"])
        if fmt == "parquet":
            import pyarrow.parquet as pq

            with fs.open(key, "rb") as fh:
                meta = pq.ParquetFile(fh)
                columns = meta.schema_arrow.names
                groups = meta.num_row_groups
            if text_field not in columns:
                raise DataError(f"{path} has no column {text_field!r} (its columns: {', '.join(columns)}); set "
                                "--text-field (data.documents.text_field) to the column that holds the text")
            return [Unit(path, fmt, g, groups, g, g + 1, size) for g in range(groups)]
    except DataError:
        raise
    except ImportError:
        raise DataError(f"{path} is Parquet: install pyarrow (pip install 'mingpt[formats]')") from None
    except Exception as e:  # noqa: BLE001
        raise unreachable(path, e) from None
    compressed = fsspec.utils.infer_compression(path) is not None
    if compressed or (fmt == "text" and separator is not None):
        return [Unit(path, fmt, 0, 1, 0, size, size)]
    n = max(1, -(-size // unit_bytes))
    return [Unit(path, fmt, k, n, k * unit_bytes, min(size, (k + 1) * unit_bytes), size) for k in range(n)]


def _cut_ok(fmt: str, before: int, after: int) -> bool:
    # text: a newline with printable ASCII, not space, on both sides: GPT-2's pre-tokenizer joins
    # nothing across it (see cache.safe_cuts); JSON lines: any newline.
    return fmt == "jsonl" or (0x21 <= before <= 0x7E and 0x21 <= after <= 0x7E)


def find_cut(fh, fmt: str, pos: int, size: int, block: int = 1 << 20) -> int:
    """The first cut at or after byte `pos`: just after a newline that may end a unit (see
    `_cut_ok`); `size` when there is none. The same for every worker that asks."""
    if pos <= 0:
        return 0
    while pos < size:
        fh.seek(pos - 1)
        data = fh.read(block + 2)
        i = data.find(b"\n", 1)
        while i != -1 and i + 1 < len(data):
            if _cut_ok(fmt, data[i - 1], data[i + 1]):
                return pos - 1 + i + 1
            i = data.find(b"\n", i + 1)
        pos += block
    return size


def _decode(raw: bytes, path: str, offset: int) -> str:
    """The text of bytes read from `offset` of a file, or an error that says how to convert it."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{path} is not UTF-8 (invalid byte at offset {offset + e.start}); convert it, e.g. "
            f"`iconv -f {_encoding(raw, offset)} -t utf-8 {Path(path).name} > out.txt`, and use the result"
        ) from None


def _encoding(raw: bytes, offset: int) -> str:
    """The likeliest encoding of text that is not UTF-8, for iconv: a byte-order mark says, NULs at
    every other byte are UTF-16 without one (the ASCII characters of it), else a one-byte encoding."""
    for bom, name in ((b"\xff\xfe\0\0", "UTF-32"), (b"\0\0\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"),
                      (b"\xfe\xff", "UTF-16")):
        if offset == 0 and raw.startswith(bom):
            return name
    head = raw[:4096]
    even, odd = head[offset % 2::2].count(0), head[1 - offset % 2::2].count(0)  # at even / odd file offsets
    if max(even, odd) > len(head) // 4:
        return "UTF-16LE" if odd > even else "UTF-16BE"
    return "latin1"


def unit_documents(unit: Unit, separator: str | None, text_field: str) -> Iterator[tuple[str, bool]]:
    """The texts of one unit, each with whether a document ends with it: every document does,
    except a whole-file text document cut into several units (it ends in its last unit)."""
    fs, key = fsspec.core.url_to_fs(unit.path)
    if unit.fmt == "parquet":
        import pyarrow.parquet as pq

        with fs.open(key, "rb") as fh:
            column = pq.ParquetFile(fh).read_row_group(unit.begin, columns=[text_field]).column(0).to_pylist()
        for row, text in enumerate(column):
            if not isinstance(text, str):
                raise DataError(f"{unit.path} row group {unit.begin} row {row}: column {text_field!r} holds a "
                                f"{type(text).__name__}, not text")
            if text.strip():
                yield text, True
        return
    if fsspec.utils.infer_compression(unit.path) is not None:
        with fsspec.open(unit.path, "rt", compression="infer", encoding="utf-8") as fh:
            try:
                lines = list(enumerate(fh, 1)) if unit.fmt == "jsonl" else [(1, fh.read())]
            except UnicodeDecodeError as e:
                raise DataError(f"{unit.path} is not UTF-8 once decompressed ({e.reason}); convert it") from None
        yield from _texts(lines, unit, separator, text_field)
        return
    with fs.open(key, "rb") as fh:
        begin = find_cut(fh, unit.fmt, unit.begin, unit.size)
        end = find_cut(fh, unit.fmt, unit.end, unit.size) if unit.part < unit.parts - 1 else unit.size
        fh.seek(begin)
        raw = fh.read(max(0, end - begin))
    text = _decode(raw, unit.path, begin)
    if unit.fmt == "jsonl":
        yield from _texts(enumerate(text.splitlines(), 1), unit, separator, text_field,
                          lines_before=lambda: _count_newlines(unit.path, begin))
    elif unit.parts > 1:
        yield text, unit.part == unit.parts - 1
    else:
        yield from _texts([(1, text)], unit, separator, text_field)


def _count_newlines(path: str, end: int) -> int:
    """The lines of `path` before byte `end`: read only to name a bad line of a later unit."""
    count, left = 0, end
    with fsspec.open(path, "rb") as fh:
        while left > 0:
            data = fh.read(min(left, 1 << 24))
            count, left = count + data.count(b"\n"), left - len(data)
    return count


def _texts(lines, unit: Unit, separator: str | None, text_field: str,
           lines_before=lambda: 0) -> Iterator[tuple[str, bool]]:
    """The documents of numbered lines (n counts from the unit's first line; `lines_before()`
    gives the file's lines before it, counted only when a line is bad)."""
    for n, line in lines:
        if unit.fmt == "jsonl":
            if line.strip():
                try:
                    doc = _jsonl_text(line, text_field, unit.path, n)
                except DataError:
                    _jsonl_text(line, text_field, unit.path, n + lines_before())  # raises, with the file's line
                    raise
                if doc.strip():
                    yield doc, True
        elif separator is None:
            if line.strip():
                yield line, True
        else:
            yield from ((d, True) for d in line.split(separator) if d.strip())


def raw_format(fmt: str, separator: str | None) -> tuple[str, str | None]:
    """How the files of a raw document corpus (data.documents.format) are read: (the file format,
    the separator of documents in a text file, None when a file is one document)."""
    return ("jsonl", None) if fmt == "jsonl" else ("text", separator if fmt == "text" else None)


def _jsonl_text(line: str, text_field: str, path: str, n: int) -> str:
    """The text of one JSON line; each way a line can be wrong gets its own message."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{path} line {n} is not valid JSON ({e.msg} at column {e.colno}); fix or remove "
                        "that line") from None
    if not isinstance(obj, dict):
        raise DataError(f"{path} line {n} is a JSON {type(obj).__name__}, not an object; every line must be an "
                        f"object such as {{\"{text_field}\": \"...\"}}")
    if text_field not in obj:
        keys = ", ".join(sorted(obj)[:10]) or "none"
        raise DataError(f"{path} line {n} has no field {text_field!r} (its fields: {keys}); set data.documents.text_field "
                        "to the field that holds the text")
    if not isinstance(obj[text_field], str):
        raise DataError(f"{path} line {n}: field {text_field!r} is a {type(obj[text_field]).__name__}, not a "
                        "string of text")
    return obj[text_field]
