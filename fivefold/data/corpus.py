"""Where documents come from: the embedded default corpus, and readers for user corpora.

The embedded corpus is the English documentation that ships inside CPython, so that a first run
needs no download. Two sources:
  * `pydoc_data.topics.topics`: the language reference topics behind `help()` (79 topics, ~465 KB);
  * docstrings of stdlib modules, classes and functions, read with `ast` from the stdlib sources
    (~1.2 MB). One document per module: its docstrings of >= 200 characters, in source order,
    joined by blank lines. Short docstrings ("Return x.") are mostly boilerplate and are dropped.

Parsing the stdlib takes several seconds, so the documents are cached as JSON, keyed by the Python
version (the stdlib, and so the corpus, only changes with it).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import sys
import sysconfig
import warnings
from pathlib import Path

from fivefold.errors import UserError

MIN_DOCSTRING_CHARS = 200
CORPUS_FORMAT = 1
# Path components never read: tests are code rather than prose, idlelib is an application, and
# site-packages is not the stdlib (its contents differ between machines).
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "__pycache__", "pydoc_data", "turtledemo"}


class DataError(UserError, ValueError):
    """Unusable input data; the message names the file (and line or byte offset) and the problem.

    Defined here, the package's lowest module, so that every data module can raise it; import it
    from `fivefold.data.dataset`."""


def cache_dir(data_cfg=None) -> Path:
    """DataConfig.cache_dir, else $FIVEFOLD_CACHE, else ~/.cache/fivefold (created if missing)."""
    configured = getattr(data_cfg, "cache_dir", "") if data_cfg is not None else ""
    path = Path(configured or os.environ.get("FIVEFOLD_CACHE") or Path.home() / ".cache" / "fivefold")
    path = path.expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def _definitions(node: ast.AST):
    """Classes and functions under `node` in source order (ast.walk is breadth-first, which would
    interleave unrelated classes), including those nested in if/try blocks."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield child
        if not isinstance(child, ast.expr):
            yield from _definitions(child)


def module_document(source: bytes) -> str:
    """The long docstrings of one module joined by blank lines ("" if it has none or does not parse)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences in old modules
            tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    parts = []
    for node in (tree, *_definitions(tree)):
        doc = ast.get_docstring(node, clean=True)
        if doc and len(doc) >= MIN_DOCSTRING_CHARS:
            parts.append(doc)
    return "\n\n".join(parts)


def stdlib_sources() -> list[Path]:
    """Stdlib .py files, sorted by their path relative to the stdlib root (deterministic)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if not _SKIP_DIRS.intersection(rel.parts[:-1]):
            files.append((rel.as_posix(), path))
    return [path for _, path in sorted(files)]


def build_embedded_documents() -> list[str]:
    """Parse the corpus from scratch (slow; use `embedded_documents`, which caches it)."""
    from pydoc_data.topics import topics

    docs = [topics[name].strip() for name in sorted(topics)]
    for path in stdlib_sources():
        doc = module_document(path.read_bytes())
        if doc:
            docs.append(doc)
    return [d for d in docs if d]


def embedded_documents(cache: str | Path | None = None) -> list[str]:
    """The embedded corpus as a list of documents, in a fixed order; cached under `cache`."""
    cache = Path(cache) if cache is not None else cache_dir()
    version = ".".join(map(str, sys.version_info[:3]))
    path = cache / f"corpus-python-{version}.json"
    if path.is_file():
        try:
            blob = json.loads(path.read_text(encoding="utf-8"))
            if blob.get("format") == CORPUS_FORMAT and blob.get("python") == sys.version:
                return blob["documents"]
        except (OSError, ValueError, KeyError):
            pass  # a corrupt cache is rebuilt below
    docs = build_embedded_documents()
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"format": CORPUS_FORMAT, "python": sys.version, "documents": docs}),
                   encoding="utf-8")
    os.replace(tmp, path)  # concurrent ranks write identical content; the last rename wins
    return docs


def split_score(text: str, seed: int) -> float:
    digest = hashlib.sha1(f"{seed}:".encode() + text.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def is_validation(text: str, val_fraction: float, seed: int = 0) -> bool:
    """Whether a document belongs to the held-out split. A function of the text alone, so the
    split does not depend on document order, on sharding, or on which other documents exist."""
    return split_score(text, seed) < val_fraction


def split_documents(docs: list[str], val_fraction: float, seed: int = 0) -> tuple[list[str], list[str]]:
    """(train_docs, val_docs), each in the input order, chosen by a stable hash of each text."""
    train, val = [], []
    for doc in docs:
        (val if is_validation(doc, val_fraction, seed) else train).append(doc)
    return train, val


def documents_hash(docs: list[str]) -> str:
    """sha256 over the documents with length prefixes (so ["ab", "c"] != ["a", "bc"])."""
    h = hashlib.sha256()
    for doc in docs:
        data = doc.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# User corpora: .txt/.md (one document per file), .jsonl (one per line, field "text"), .parquet
# (column "text"). Every error names the file, and the line or byte offset where there is one.

TEXT_SUFFIXES = (".txt", ".md")
SUFFIXES = TEXT_SUFFIXES + (".jsonl", ".parquet")


def expand_inputs(inputs) -> list[Path]:
    """Files, and directories searched recursively for supported files (sorted, hidden ones skipped)."""
    files: list[Path] = []
    for item in inputs:
        path = Path(item).expanduser()
        if path.is_dir():
            found = sorted((p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in SUFFIXES
                            and not any(part.startswith(".") for part in p.relative_to(path).parts)),
                           key=lambda p: p.relative_to(path).as_posix())
            if not found:
                raise DataError(f"{path}: directory has no {', '.join(SUFFIXES)} files")
            files.extend(found)
        elif path.is_file():
            if path.suffix.lower() not in SUFFIXES:
                raise DataError(f"{path}: unsupported file type {path.suffix or '(none)'!r}; "
                                f"use {', '.join(SUFFIXES)}")
            files.append(path)
        else:
            raise DataError(f"{path}: no such file or directory")
    if not files:
        raise DataError("no input files given")
    return files


def _decode(path: Path, data: bytes, offset: int = 0, where: str = "") -> str:
    # A NUL byte is valid UTF-8 but in practice means a binary file given by mistake.
    bad = data.find(b"\0")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        bad = e.start if bad < 0 else min(bad, e.start)
    if bad >= 0:
        raise DataError(f"{path}{where}: not UTF-8 text (byte 0x{data[bad]:02x} at offset {offset + bad})")
    return text


def jsonl_objects(path: Path):
    """(line number, JSON value) of each non-blank line of a JSONL file (a leading BOM ignored); bytes that
    are not UTF-8 and lines that are not JSON are DataErrors naming the line."""
    offset = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            line = _decode(path, raw, offset, f":{lineno}")
            offset += len(raw)
            if lineno == 1:
                line = line.removeprefix("\ufeff")
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({getattr(e, 'msg', e)})") from None
            yield lineno, obj


def _read_jsonl(path: Path):
    for lineno, obj in jsonl_objects(path):
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise DataError(f'{path}:{lineno}: expected a JSON object with a string "text" field')
        try:
            obj["text"].encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate escape such as "\ud800"
            raise DataError(f"{path}:{lineno}: the text is not valid Unicode (lone surrogate)") from None
        yield obj["text"]


def _read_parquet(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading .parquet needs pyarrow; pip install pyarrow") from None
    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for non-parquet data
        raise DataError(f"{path}: not a readable parquet file ({e})") from None
    names = parquet.schema_arrow.names
    if "text" not in names:
        raise DataError(f'{path}: no "text" column (columns: {", ".join(names)})')
    row = 0
    for batch in parquet.iter_batches(columns=["text"], batch_size=1024):
        for text in batch.column(0).to_pylist():
            row += 1
            if text is None:
                continue
            if not isinstance(text, str):
                raise DataError(f'{path}: row {row}: column "text" holds {type(text).__name__}, not strings')
            yield text


def iter_documents(files: list[Path]):
    """The documents of `files` in order, as strings."""
    for path in files:
        suffix = path.suffix.lower()
        if suffix in TEXT_SUFFIXES:
            yield _decode(path, path.read_bytes()).removeprefix("\ufeff")
        elif suffix == ".jsonl":
            yield from _read_jsonl(path)
        elif suffix == ".parquet":
            yield from _read_parquet(path)
        else:
            raise DataError(f"{path}: unsupported file type {suffix!r}; use {', '.join(SUFFIXES)}")
