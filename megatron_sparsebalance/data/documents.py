"""Repository-level documents from source trees every machine has: its installed Python packages.

A long-context benchmark needs long, real, structured text, and a machine without the internet
still has megabytes of it in ``site-packages``. One *document* is the text files of one package
directory concatenated in a fixed order, each preceded by a header line with its path, like the
repository-level code corpora long-context models are trained on.

Rules (each one makes the output a pure function of the files on disk):

- A *package* is a top-level directory of a search root that holds at least one ``.py`` file
  (``*.dist-info``, ``__pycache__`` and dot-directories are skipped). Its name is the directory's.
- Files: the suffixes in :data:`TEXT_SUFFIXES`, at most :data:`MAX_FILE_BYTES` each (bigger ones
  are generated tables, not prose or code), UTF-8 only; anything else is left out.
- Order: paths relative to the search root, sorted as strings with ``/`` separators.
- Header: ``HEADER.format(path=...)`` before each file's text.
- Size: a package whose text exceeds ``max_chars`` is cut along its directory tree: every
  sub-directory whose own tree still exceeds ``max_chars`` becomes documents of its own
  (recursively), the files directly in a directory plus its small sub-trees form that directory's
  document. So each document is a whole directory tree of source, up to ``max_chars`` (a single
  directory's own files may exceed it).
- Held-out split BY PACKAGE: a package is held out when the first 8 bytes of SHA-256 of its name,
  as a fraction of 2^64, are below ``valid_fraction``; every document of a package goes to its
  package's split, so no source file is in both. The rule depends on the name only, so a package
  lands in the same split on every machine. If it would leave one split empty (few packages), the
  package with the smallest hash is held out, or the largest kept.
"""
from __future__ import annotations

import hashlib
import json
import os
import site
import sysconfig
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional, Sequence

TEXT_SUFFIXES = (".py", ".pyi", ".pyx", ".pxd", ".md", ".rst", ".txt", ".cfg", ".toml", ".ini", ".c", ".h", ".cpp",
                 ".cu", ".cuh")
MAX_FILE_BYTES = 256 * 1024
# ~300K tokens of code with a 49K BPE vocabulary: well above the longest sample of any mix (72K).
DEFAULT_MAX_CHARS = 1_000_000
HEADER = "\n### file: {path}\n"
SKIP_DIRS = ("__pycache__",)


@dataclass(frozen=True)
class Document:
    package: str
    """Top-level package the document belongs to (the unit of the held-out split)."""
    root: str
    """The directory (relative to the search root, ``/``-separated) whose tree the document holds."""
    files: tuple[str, ...]
    """Relative paths of the concatenated files, in order."""
    text: str

    def record(self) -> dict:
        return {"text": self.text, "package": self.package, "root": self.root, "files": len(self.files)}


def default_search_roots() -> list[str]:
    """The running interpreter's package directories (purelib and platlib, deduplicated)."""
    roots = []
    for path in (sysconfig.get_paths().get("purelib"), sysconfig.get_paths().get("platlib"), *site.getsitepackages()):
        if path and os.path.isdir(path) and os.path.realpath(path) not in {os.path.realpath(r) for r in roots}:
            roots.append(path)
    return roots


def _skipped_dir(name: str) -> bool:
    return name.startswith(".") or name.endswith(".dist-info") or name.endswith(".egg-info") or name in SKIP_DIRS


def find_packages(root: str) -> list[str]:
    """Top-level package directories of ``root`` holding a ``.py`` file somewhere, sorted by name."""
    found = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if not os.path.isdir(path) or os.path.islink(path) or _skipped_dir(name):
            continue
        if any(f.endswith(".py") for _, _, files in os.walk(path) for f in files):
            found.append(name)
    return found


def _read_text(path: str) -> Optional[str]:
    if not path.endswith(TEXT_SUFFIXES) or os.path.islink(path) or os.path.getsize(path) > MAX_FILE_BYTES:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (UnicodeDecodeError, OSError):
        return None


class _Tree:
    """A directory with its readable files (``(relpath, text)``) and sub-trees, sizes precomputed."""

    def __init__(self, root: str, rel: str):
        here = os.path.join(root, rel)
        self.rel = rel
        self.files: list[tuple[str, str]] = []
        self.children: list["_Tree"] = []
        for name in sorted(os.listdir(here)):
            path = os.path.join(here, name)
            if os.path.isdir(path) and not os.path.islink(path):
                if not _skipped_dir(name):
                    child = _Tree(root, f"{rel}/{name}")
                    if child.chars:
                        self.children.append(child)
            elif os.path.isfile(path):
                text = _read_text(path)
                if text:
                    self.files.append((f"{rel}/{name}", text))
        self.own_chars = sum(len(HEADER.format(path=p)) + len(t) for p, t in self.files)
        self.chars = self.own_chars + sum(c.chars for c in self.children)

    def all_files(self) -> Iterator[tuple[str, str]]:
        yield from self.files
        for c in self.children:
            yield from c.all_files()


def _render(package: str, rel: str, files: Sequence[tuple[str, str]]) -> Document:
    files = sorted(files)  # one global string order, across sub-directories too
    text = "".join(HEADER.format(path=p) + t for p, t in files)
    return Document(package, rel, tuple(p for p, _ in files), text)


def _cut(package: str, tree: _Tree, max_chars: int) -> list[Document]:
    if tree.chars <= max_chars:
        return [_render(package, tree.rel, list(tree.all_files()))]
    docs, own = [], list(tree.files)
    for child in tree.children:
        if child.chars > max_chars:
            docs += _cut(package, child, max_chars)
        else:
            own += list(child.all_files())
    if own:
        docs.insert(0, _render(package, tree.rel, own))
    return docs


def package_documents(root: str, package: str, max_chars: int = DEFAULT_MAX_CHARS) -> list[Document]:
    """The documents of one package directory under ``root`` (see the module's rules)."""
    if max_chars < 1:
        raise ValueError(f"--max-document-chars must be >= 1, got {max_chars}")
    tree = _Tree(root, package)
    return _cut(package, tree, max_chars) if tree.chars else []


def package_hash(name: str) -> float:
    """The package's position in [0, 1) for the held-out split."""
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big") / 2**64


def split_packages(names: Iterable[str], valid_fraction: float) -> tuple[list[str], list[str]]:
    """``(train, valid)`` package names (sorted) by the hash rule of the module docstring."""
    if not 0.0 < valid_fraction < 1.0:
        raise ValueError(f"--valid-fraction must be in (0, 1), got {valid_fraction}")
    names = sorted(set(names))
    valid = [n for n in names if package_hash(n) < valid_fraction]
    train = [n for n in names if package_hash(n) >= valid_fraction]
    by_hash = sorted(names, key=package_hash)
    if len(names) >= 2 and not valid:
        valid, train = [by_hash[0]], [n for n in names if n != by_hash[0]]
    elif len(names) >= 2 and not train:
        train, valid = [by_hash[-1]], [n for n in names if n != by_hash[-1]]
    return train, valid


@dataclass
class DocumentSet:
    train: list
    valid: list
    packages: dict
    """``{"train": [...], "valid": [...]}`` package names."""
    roots: list


def build_documents(roots: Sequence[str], valid_fraction: float = 0.1, max_chars: int = DEFAULT_MAX_CHARS,
                    include: Optional[Sequence[str]] = None, exclude: Sequence[str] = (),
                    max_total_chars: Optional[int] = None) -> DocumentSet:
    """Documents of every package under ``roots`` (a name found in several roots: the first root's).

    ``include`` keeps only those packages; with ``max_total_chars`` packages are taken in order of
    their split hash (so the choice does not favour early letters) and one that would take the
    text past the budget is skipped. Training documents come in package-name order, then by
    directory.
    """
    for r in roots:
        if not os.path.isdir(r):
            raise ValueError(f"--source-root {r!r}: no such directory")
    where: dict[str, str] = {}
    for r in roots:
        for name in find_packages(r):
            where.setdefault(name, r)
    if include is not None:
        unknown = sorted(set(include) - set(where))
        if unknown:
            raise ValueError(f"--packages: not found under {list(roots)}: {unknown}")
        where = {n: where[n] for n in include}
    for n in exclude:
        where.pop(n, None)
    if not where:
        raise ValueError(f"no package with Python source under {list(roots)}")
    docs: dict[str, list[Document]] = {}
    total = 0
    for name in sorted(where, key=lambda n: (package_hash(n), n)):
        found = package_documents(where[name], name, max_chars)
        size = sum(len(d.text) for d in found)
        # A package that would pass the budget is left out whole (a split package would put half
        # a source tree in the data); smaller ones later in the order may still fit.
        if found and (max_total_chars is None or total + size <= max_total_chars):
            docs[name] = found
            total += size
    train_names, valid_names = split_packages(docs, valid_fraction)
    return DocumentSet(train=[d for n in train_names for d in docs[n]], valid=[d for n in valid_names for d in docs[n]],
                       packages={"train": train_names, "valid": valid_names}, roots=list(roots))


def write_jsonl(path: str, documents: Sequence[Document]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for d in documents:
            f.write(json.dumps(d.record(), ensure_ascii=False) + "\n")
