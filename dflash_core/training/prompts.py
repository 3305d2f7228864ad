"""Training prompts for a DFlash drafter, from sources that are all legal to use and all offline.

A drafter learns to predict what its *target* will say, so the responses to these prompts are the target's own
(:mod:`.responses`, :mod:`.datagen`), never reference answers. Prompt sources:

* ``gsm8k`` / ``math500`` / ``humaneval``: :func:`.pools.catalog.training_split`, i.e. pool items the benchmark can
  never select (the test suite checks the ids against :func:`.pools.catalog.benchmark_pool_ids`);
* ``stdlib``: coding and explanation tasks built from the docstrings of Python's own standard library (PSF license);
* ``code-tasks``: self-written classic programming exercises, asked plainly and as HumanEval-style stubs;
* ``math-templates``: self-written arithmetic word problems and small algebra exercises with random numbers;
* ``chat``: self-written seed topics crossed with instruction templates (tips, explanations, emails, stories, ...);
* ``package-docs``: coding and explanation tasks from the docstrings of the installed packages (their licences are
  in the text corpus's manifest, :mod:`.textcorpus`, except for those of SWE-bench Lite's repositories, which the
  corpus does not read but this pool keeps: committed shards name its prompts, see :func:`.textcorpus.package_files`).
"""

from __future__ import annotations

import importlib
import inspect
import random
from dataclasses import dataclass

__all__ = ["PromptItem", "build_prompts"]

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class PromptItem:
    source: str  # one of the sources listed in the module docstring
    prompt_id: str  # unique across sources: "<source>:<id>"
    text: str  # the user message


# ---------------------------------------------------------------------------------------------------- benchmark pools
def benchmark_training_prompts() -> list[PromptItem]:
    """Training-split items of the offline pools (never benchmark-eligible), in the benchmark's prompt format."""
    from .pools.catalog import training_split
    from .pools.items import DatasetUnavailableError

    items = []
    for name in ("gsm8k", "math500", "humaneval"):
        try:
            split = training_split(name)
        except DatasetUnavailableError:
            continue
        items += [PromptItem(name, f"{name}:{it.sample_id}", it.turns[0]) for it in split]
    return items


# ---------------------------------------------------------------------------------------------------- stdlib docstrings
STDLIB_MODULES = (
    "os", "os.path", "re", "json", "itertools", "collections", "functools", "string", "math", "statistics",
    "datetime", "textwrap", "random", "heapq", "bisect", "pathlib", "shutil", "csv", "operator", "copy", "glob",
    "fnmatch", "hashlib", "base64", "binascii", "struct", "zlib", "gzip", "difflib", "html", "urllib.parse",
    "calendar", "time", "decimal", "fractions", "cmath", "array", "enum", "dataclasses", "typing", "contextlib",
    "io", "tempfile", "subprocess", "threading", "queue", "logging", "argparse", "uuid", "secrets", "pprint",
    "shlex", "unicodedata", "zipfile", "tarfile", "sqlite3", "socket", "select", "inspect", "ast", "tokenize",
    "dis", "weakref", "abc", "numbers", "keyword", "locale", "gettext", "platform", "sys", "signal", "pickle",
    "configparser", "email.utils", "mimetypes", "ipaddress", "http.client", "xml.etree.ElementTree", "timeit",
    "concurrent.futures", "asyncio", "colorsys", "graphlib", "reprlib", "traceback", "warnings",
)

_STDLIB_TEMPLATES = (
    "Write a Python function that uses `{qual}` ({doc}). Show an example call and its output.",
    "Explain and give an example of `{qual}`: {doc}",
    "How do I use `{qual}` in Python? The documentation says: \"{doc}\" Give a short code example.",
    "Write a small Python script that demonstrates `{qual}`. {doc}",
    "Write a Python function that does the following without using `{qual}`: {doc_lower}",
    "What does `{qual}` return, and when would I use it? ({doc})",
)


def _first_doc_line(obj) -> str | None:
    try:
        doc = inspect.getdoc(obj)
    except Exception:
        return None
    if not doc:
        return None
    line = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
    if len(line) < 12 or len(line) > 300 or line.startswith(("(", "[")) or "(" in line[:30] and "->" in line:
        return None
    return line


def stdlib_prompts(seed: int = 0) -> list[PromptItem]:
    """Coding / explanation tasks from the first docstring line of public stdlib functions, classes and methods."""
    rng = random.Random(f"stdlib:{seed}")
    items, seen = [], set()
    for mod_name in STDLIB_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except Exception:
            continue
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or not callable(obj) or getattr(obj, "__module__", mod_name) not in (
                    mod_name, mod.__name__, "_" + mod_name.split(".")[-1], "posixpath", "builtins"):
                continue
            targets = [(f"{mod_name}.{name}", obj)]
            if inspect.isclass(obj):  # a few public methods of each class as well
                targets += [(f"{mod_name}.{name}.{m}", f) for m, f in sorted(vars(obj).items())
                            if not m.startswith("_") and callable(f)][:4]
            for qual, target in targets:
                doc = _first_doc_line(target)
                if doc is None or qual in seen:
                    continue
                seen.add(qual)
                template = rng.choice(_STDLIB_TEMPLATES)
                text = template.format(qual=qual, doc=doc, doc_lower=doc[0].lower() + doc[1:])
                items.append(PromptItem("stdlib", f"stdlib:{qual}", text))
    return items


# packages whose public API a user of this target would plausibly ask about (not model classes or font tables)
DOC_PROMPT_PACKAGES = ("numpy", "scipy", "sympy", "mpmath", "networkx", "torch", "matplotlib", "requests", "click",
                       "rich", "pydantic", "jinja2", "yaml", "dateutil", "packaging", "tqdm", "huggingface_hub")


def _package_docstrings() -> tuple[tuple[str, str], ...]:
    """(qualified name, first docstring paragraph) of the module-level public functions and classes of
    DOC_PROMPT_PACKAGES, found by a pattern over the source text (no import, no parse: a few seconds)."""
    import re

    from .textcorpus import _module_name, package_files

    pattern = re.compile(r'^(?:def|class)\s+([A-Za-z]\w*)\b[^\n]*:[ \t]*\n[ \t]+[rRuU]?("""|\'\'\')(.*?)(?:\n[ \t]*\n|\2)',
                         re.MULTILINE | re.DOTALL)
    found: dict[str, str] = {}
    site, files, _ = package_files(DOC_PROMPT_PACKAGES, benchmark_repositories=True)  # the pool committed shards name
    for rel in files:
        private = rel.name.startswith("_") and rel.name != "__init__.py"
        if private or any(part.startswith("_") or part in ("tests", "testing") for part in rel.parts[:-1]):
            continue
        try:
            text = (site / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        module = _module_name(rel)
        for match in pattern.finditer(text):
            line = " ".join(match.group(3).split())
            if 12 <= len(line) <= 300 and not line.startswith(("(", "[", ">>>", "..")):
                found.setdefault(f"{module}.{match.group(1)}", line)
    return tuple(sorted(found.items()))


def package_doc_prompts(limit: int = 5000, seed: int = 0) -> list[PromptItem]:
    """Coding / explanation tasks from the first docstring paragraph of public module-level functions and classes of
    the installed DOC_PROMPT_PACKAGES (:func:`.textcorpus.package_files`), ``limit`` of them in a seeded choice. The
    prompts change with the installed versions: shards keep the prompt keys, and a prompt that no longer rebuilds is
    skipped at load time (:func:`.corpus.load_corpus`)."""
    found = dict(_package_docstrings())
    quals = sorted(found)
    rng = random.Random(f"package-docs:{seed}")
    rng.shuffle(quals)
    items = []
    for qual in sorted(quals[:limit]):
        doc = found[qual]
        text = rng.choice(_STDLIB_TEMPLATES).format(qual=qual, doc=doc, doc_lower=doc[0].lower() + doc[1:])
        items.append(PromptItem("package-docs", f"package-docs:{qual}", text))
    return items


# ---------------------------------------------------------------------------------------------------- code tasks
# (function name, signature, task description, example call, example result)
_CODE_TASKS = (
    ("is_palindrome", "s: str) -> bool", "Return True if s reads the same forwards and backwards, ignoring case and non-letters.", "is_palindrome('A man, a plan')", "False"),
    ("fizzbuzz", "n: int) -> list", "Return the FizzBuzz sequence from 1 to n as strings.", "fizzbuzz(5)", "['1', '2', 'Fizz', '4', 'Buzz']"),
    ("count_vowels", "text: str) -> int", "Count the vowels in text.", "count_vowels('hello')", "2"),
    ("flatten", "nested: list) -> list", "Flatten an arbitrarily nested list of integers.", "flatten([1, [2, [3]]])", "[1, 2, 3]"),
    ("merge_sorted", "a: list, b: list) -> list", "Merge two sorted lists into one sorted list.", "merge_sorted([1, 3], [2, 4])", "[1, 2, 3, 4]"),
    ("binary_search", "items: list, target: int) -> int", "Return the index of target in the sorted list items, or -1.", "binary_search([1, 3, 5], 5)", "2"),
    ("gcd", "a: int, b: int) -> int", "Return the greatest common divisor of a and b.", "gcd(12, 18)", "6"),
    ("is_prime", "n: int) -> bool", "Return True if n is a prime number.", "is_prime(7)", "True"),
    ("primes_below", "n: int) -> list", "Return all primes smaller than n using the sieve of Eratosthenes.", "primes_below(10)", "[2, 3, 5, 7]"),
    ("fibonacci", "n: int) -> int", "Return the n-th Fibonacci number (fibonacci(0) == 0).", "fibonacci(10)", "55"),
    ("factorial", "n: int) -> int", "Return n! computed iteratively.", "factorial(5)", "120"),
    ("reverse_words", "sentence: str) -> str", "Reverse the order of the words in a sentence.", "reverse_words('hello big world')", "'world big hello'"),
    ("word_count", "text: str) -> dict", "Return a dictionary mapping each lowercase word to its count.", "word_count('a b a')", "{'a': 2, 'b': 1}"),
    ("anagrams", "a: str, b: str) -> bool", "Return True if a and b are anagrams of each other.", "anagrams('listen', 'silent')", "True"),
    ("max_subarray", "nums: list) -> int", "Return the largest sum of a contiguous subarray (Kadane's algorithm).", "max_subarray([-2, 1, -3, 4, -1, 2])", "5"),
    ("two_sum", "nums: list, target: int) -> tuple", "Return indices of two numbers that add up to target.", "two_sum([2, 7, 11], 9)", "(0, 1)"),
    ("rotate_list", "items: list, k: int) -> list", "Rotate a list to the right by k steps.", "rotate_list([1, 2, 3, 4], 1)", "[4, 1, 2, 3]"),
    ("chunk", "items: list, size: int) -> list", "Split items into consecutive chunks of the given size.", "chunk([1, 2, 3, 4, 5], 2)", "[[1, 2], [3, 4], [5]]"),
    ("unique_in_order", "items: list) -> list", "Remove duplicates while keeping the first occurrence order.", "unique_in_order([3, 1, 3, 2])", "[3, 1, 2]"),
    ("roman_to_int", "s: str) -> int", "Convert a Roman numeral to an integer.", "roman_to_int('XIV')", "14"),
    ("int_to_roman", "n: int) -> str", "Convert an integer between 1 and 3999 to a Roman numeral.", "int_to_roman(14)", "'XIV'"),
    ("balanced_brackets", "s: str) -> bool", "Return True if every bracket in s is closed in the right order.", "balanced_brackets('([]{})')", "True"),
    ("caesar_cipher", "text: str, shift: int) -> str", "Shift every letter of text by shift positions in the alphabet.", "caesar_cipher('abc', 1)", "'bcd'"),
    ("digits_sum", "n: int) -> int", "Return the sum of the decimal digits of n.", "digits_sum(1234)", "10"),
    ("transpose", "matrix: list) -> list", "Return the transpose of a matrix given as a list of rows.", "transpose([[1, 2], [3, 4]])", "[[1, 3], [2, 4]]"),
    ("matrix_multiply", "a: list, b: list) -> list", "Multiply two matrices given as lists of rows.", "matrix_multiply([[1, 2]], [[3], [4]])", "[[11]]"),
    ("longest_common_prefix", "words: list) -> str", "Return the longest common prefix of a list of strings.", "longest_common_prefix(['flow', 'flower'])", "'flow'"),
    ("run_length_encode", "s: str) -> str", "Compress s with run-length encoding.", "run_length_encode('aaabcc')", "'a3b1c2'"),
    ("is_leap_year", "year: int) -> bool", "Return True if year is a leap year in the Gregorian calendar.", "is_leap_year(2000)", "True"),
    ("celsius_to_fahrenheit", "c: float) -> float", "Convert a temperature from Celsius to Fahrenheit.", "celsius_to_fahrenheit(100)", "212.0"),
    ("second_largest", "nums: list) -> int", "Return the second largest distinct number in nums.", "second_largest([4, 1, 4, 3])", "3"),
    ("count_islands", "grid: list) -> int", "Count groups of connected 1s (up, down, left, right) in a grid.", "count_islands([[1, 0], [0, 1]])", "2"),
    ("median", "nums: list) -> float", "Return the median of a non-empty list of numbers.", "median([3, 1, 2])", "2"),
    ("capitalize_words", "s: str) -> str", "Capitalize the first letter of every word.", "capitalize_words('hello world')", "'Hello World'"),
    ("pascal_triangle", "n: int) -> list", "Return the first n rows of Pascal's triangle.", "pascal_triangle(3)", "[[1], [1, 1], [1, 2, 1]]"),
    ("binary_to_decimal", "bits: str) -> int", "Convert a binary string to an integer.", "binary_to_decimal('101')", "5"),
    ("decimal_to_binary", "n: int) -> str", "Convert a non-negative integer to its binary string.", "decimal_to_binary(5)", "'101'"),
    ("common_elements", "a: list, b: list) -> list", "Return the sorted list of elements present in both lists.", "common_elements([1, 2, 3], [2, 3, 4])", "[2, 3]"),
    ("valid_email", "address: str) -> bool", "Return True if address looks like a valid e-mail address.", "valid_email('a@b.com')", "True"),
    ("bubble_sort", "nums: list) -> list", "Sort a list with bubble sort and return it.", "bubble_sort([3, 1, 2])", "[1, 2, 3]"),
    ("quick_sort", "nums: list) -> list", "Sort a list with quicksort and return a new list.", "quick_sort([3, 1, 2])", "[1, 2, 3]"),
    ("merge_sort", "nums: list) -> list", "Sort a list with merge sort and return a new list.", "merge_sort([3, 1, 2])", "[1, 2, 3]"),
    ("power_set", "items: list) -> list", "Return all subsets of items.", "power_set([1, 2])", "[[], [1], [2], [1, 2]]"),
    ("permutations_of", "s: str) -> list", "Return all permutations of the characters of s.", "permutations_of('ab')", "['ab', 'ba']"),
    ("lcm", "a: int, b: int) -> int", "Return the least common multiple of a and b.", "lcm(4, 6)", "12"),
    ("mean_and_std", "nums: list) -> tuple", "Return the mean and population standard deviation of nums.", "mean_and_std([1, 1, 1])", "(1.0, 0.0)"),
    ("parse_csv_line", "line: str) -> list", "Split a CSV line on commas, honouring double-quoted fields.", "parse_csv_line('a,\"b,c\",d')", "['a', 'b,c', 'd']"),
    ("group_by_length", "words: list) -> dict", "Group words into a dictionary keyed by word length.", "group_by_length(['a', 'bb', 'c'])", "{1: ['a', 'c'], 2: ['bb']}"),
    ("is_sorted", "nums: list) -> bool", "Return True if nums is sorted in non-decreasing order.", "is_sorted([1, 2, 2])", "True"),
    ("missing_number", "nums: list) -> int", "Given the numbers 0..n with one missing, return the missing one.", "missing_number([0, 1, 3])", "2"),
    ("vowel_positions", "s: str) -> list", "Return the indices of the vowels in s.", "vowel_positions('hello')", "[1, 4]"),
    ("sum_of_squares", "n: int) -> int", "Return 1^2 + 2^2 + ... + n^2.", "sum_of_squares(3)", "14"),
    ("count_char", "s: str, c: str) -> int", "Count how often character c occurs in s.", "count_char('banana', 'a')", "3"),
    ("dict_invert", "d: dict) -> dict", "Swap the keys and values of a dictionary.", "dict_invert({'a': 1})", "{1: 'a'}"),
    ("running_sum", "nums: list) -> list", "Return the running (prefix) sums of nums.", "running_sum([1, 2, 3])", "[1, 3, 6]"),
    ("collatz_steps", "n: int) -> int", "Return how many Collatz steps it takes n to reach 1.", "collatz_steps(6)", "8"),
    ("hamming_distance", "a: str, b: str) -> int", "Return the number of positions where two equal-length strings differ.", "hamming_distance('abc', 'abd')", "1"),
    ("title_case", "s: str) -> str", "Convert snake_case to TitleCase.", "title_case('hello_world')", "'HelloWorld'"),
    ("snake_case", "s: str) -> str", "Convert CamelCase to snake_case.", "snake_case('HelloWorld')", "'hello_world'"),
    ("perfect_number", "n: int) -> bool", "Return True if n equals the sum of its proper divisors.", "perfect_number(6)", "True"),
    ("armstrong_number", "n: int) -> bool", "Return True if n is the sum of its digits each raised to the number of digits.", "armstrong_number(153)", "True"),
    ("nth_prime", "n: int) -> int", "Return the n-th prime number (nth_prime(1) == 2).", "nth_prime(4)", "7"),
    ("matrix_trace", "m: list) -> int", "Return the sum of the main diagonal of a square matrix.", "matrix_trace([[1, 2], [3, 4]])", "5"),
    ("strip_punctuation", "s: str) -> str", "Remove all punctuation characters from s.", "strip_punctuation('hi, you!')", "'hi you'"),
    ("find_duplicates", "nums: list) -> list", "Return the sorted values that occur more than once.", "find_duplicates([1, 2, 1, 3, 2])", "[1, 2]"),
    ("climb_stairs", "n: int) -> int", "Count the ways to climb n stairs taking 1 or 2 steps at a time.", "climb_stairs(4)", "5"),
    ("edit_distance", "a: str, b: str) -> int", "Return the Levenshtein distance between a and b.", "edit_distance('kitten', 'sitting')", "3"),
    ("longest_increasing_subsequence", "nums: list) -> int", "Return the length of the longest strictly increasing subsequence.", "longest_increasing_subsequence([3, 1, 2, 5])", "3"),
    ("coin_change", "coins: list, amount: int) -> int", "Return the fewest coins needed to make amount, or -1.", "coin_change([1, 2, 5], 11)", "3"),
    ("knapsack", "weights: list, values: list, capacity: int) -> int", "Return the best total value of a 0/1 knapsack.", "knapsack([1, 2], [3, 4], 2)", "4"),
    ("top_k_frequent", "nums: list, k: int) -> list", "Return the k most frequent values.", "top_k_frequent([1, 1, 2, 3, 3, 3], 2)", "[3, 1]"),
)

_CODE_TASK_TEMPLATES = (
    "Write a Python function `{name}({sig}` that does the following: {desc} For example, `{call}` returns `{result}`.",
    "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
    "def {name}({sig}:\n    \"\"\"{desc}\n    >>> {call}\n    {result}\n    \"\"\"\n```",
    "Complete the following Python function:\n```python\ndef {name}({sig}:\n    \"\"\"{desc}\"\"\"\n```",
    "Implement `{name}` in Python. {desc} Include a docstring and a few test cases.",
    "Explain step by step how to write a Python function that does this: {desc_lower} Then give the code.",
    "Write {name} in Python with type hints, then write unit tests for it using unittest. Task: {desc}",
    "Here is a task: {desc} Write an efficient Python solution and explain its time complexity.",
)


def code_task_prompts() -> list[PromptItem]:
    items = []
    for name, sig, desc, call, result in _CODE_TASKS:
        for t, template in enumerate(_CODE_TASK_TEMPLATES):
            text = template.format(name=name, sig=sig, desc=desc, desc_lower=desc[0].lower() + desc[1:],
                                   call=call, result=result)
            items.append(PromptItem("code-tasks", f"code-tasks:{name}:{t}", text))
    return items


# ---------------------------------------------------------------------------------------------------- math templates
_NAMES = ("Alice", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jamal", "Kira", "Liam", "Maya",
          "Noah", "Olivia", "Pedro", "Quinn", "Rosa", "Sam", "Tara", "Umar", "Vera", "Will", "Yuki", "Zoe")
_THINGS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "cards", "eggs", "flowers", "coins",
           "toy cars", "cupcakes", "shells", "stamps", "balloons")


def _math_problem(rng: random.Random) -> str:
    a, b, c = rng.randint(3, 60), rng.randint(2, 25), rng.randint(2, 12)
    n1, n2 = rng.sample(_NAMES, 2)
    thing = rng.choice(_THINGS)
    price = rng.choice((0.5, 0.75, 1.25, 2, 3, 4.5, 5, 8, 12))
    kind = rng.randrange(14)
    problems = (
        f"{n1} has {a} {thing}. {n2} gives {n1} {b} more, and then {n1} gives away {c}. How many {thing} does {n1} have now?",
        f"{n1} buys {b} packs of {thing}. Each pack holds {c} {thing} and costs ${price}. How many {thing} does {n1} have, and how much did they cost?",
        f"A store sells {thing} for ${price} each. {n1} has ${a}. How many {thing} can {n1} buy, and how much money is left?",
        f"{n1} reads {b} pages a day. The book has {a * c} pages. How many days does it take to finish the book?",
        f"{n1} is {b} years old. {n2} is {c} years older than twice {n1}'s age. How old is {n2}?",
        f"A train travels at {a} km per hour for {c} hours and then at {b} km per hour for 2 hours. How far does it travel in total?",
        f"{n1} earns ${a} per hour and works {c} hours a day for {b} days. How much does {n1} earn?",
        f"A rectangle is {a} cm long and {b} cm wide. What are its area and its perimeter?",
        f"Solve for x: {c}x + {a} = {a + c * b}.",
        f"What is {a}% of {b * 20}?",
        f"The price of a jacket is ${a * 4}. It is discounted by {rng.choice((10, 15, 20, 25, 30))}%. What is the new price?",
        f"Find the sum of all integers from 1 to {a * 3}.",
        f"What is the greatest common divisor of {a * c} and {b * c}?",
        f"{n1} and {n2} share {a * 6} {thing} in the ratio {rng.randint(1, 4)}:{rng.randint(1, 5)}. How many does each get?",
    )
    return problems[kind]


def math_template_prompts(n: int, seed: int = 0) -> list[PromptItem]:
    rng = random.Random(f"math:{seed}")
    items, seen = [], set()
    while len(items) < n:
        problem = _math_problem(rng)
        if problem in seen:
            continue
        seen.add(problem)
        text = problem + MATH_SUFFIX if rng.random() < 0.7 else problem
        items.append(PromptItem("math-templates", f"math-templates:{len(items)}", text))
    return items


# ---------------------------------------------------------------------------------------------------- chat seeds
_TOPICS = (
    "staying healthy", "learning a new language", "saving money", "climate change", "photosynthesis", "black holes",
    "the French Revolution", "machine learning", "time management", "public speaking", "writing a resume",
    "job interviews", "remote work", "meditation", "the water cycle", "volcanoes", "the Roman Empire", "democracy",
    "renewable energy", "electric cars", "social media", "online privacy", "cooking pasta", "baking bread",
    "growing tomatoes", "keeping a cat", "training a dog", "traveling to Japan", "camping", "running a marathon",
    "learning to play guitar", "studying for exams", "the human heart", "vaccines", "sleep", "coffee", "chess",
    "the history of the internet", "blockchain", "quantum computers", "the solar system", "the moon landing",
    "ancient Egypt", "Shakespeare", "impressionist painting", "jazz music", "recycling", "urban gardening",
    "starting a small business", "marketing on a budget", "negotiating a salary", "team leadership",
    "giving feedback", "conflict resolution", "friendship", "moving to a new city", "buying a used car",
    "first aid", "earthquakes", "the immune system", "DNA", "evolution", "the stock market", "inflation",
    "cryptography", "the Python programming language", "version control with git", "databases", "web browsers",
    "open source software", "artificial intelligence ethics", "space exploration", "ocean currents", "rainforests",
    "bees", "dinosaurs", "the Olympic Games", "football", "yoga", "healthy breakfasts", "minimalism",
    "reading more books", "writing poetry", "photography", "video games", "board games", "birthday parties",
    "wedding planning", "home organization", "energy saving at home", "electricity", "magnets", "rainbows",
    "the printing press", "the industrial revolution", "world war one", "the Renaissance", "mountains",
    "deserts", "coral reefs", "wind turbines", "nuclear power", "recipes for soup", "tea ceremonies",
)

_CHAT_TEMPLATES = (
    "Give me three tips for {t}.",
    "Explain {t} to a ten-year-old.",
    "What are the pros and cons of {t}?",
    "Write a short story that involves {t}.",
    "Write a short poem about {t}.",
    "Write an email to a friend about {t}.",
    "Summarize the most important facts about {t} in five bullet points.",
    "I'm a beginner. How should I get started with {t}?",
    "What are common misconceptions about {t}?",
    "Write a blog post introduction about {t}.",
    "Give me a step-by-step plan related to {t}.",
    "Compare {t} with something similar and explain the differences.",
    "Create a short quiz with answers about {t}.",
    "Write a persuasive paragraph about why people should care about {t}.",
    "What questions should I ask an expert on {t}?",
    "Describe {t} in one paragraph, then list three interesting facts.",
)


def chat_prompts(n: int, seed: int = 0) -> list[PromptItem]:
    rng = random.Random(f"chat:{seed}")
    pairs = [(t, k) for t in range(len(_TOPICS)) for k in range(len(_CHAT_TEMPLATES))]
    rng.shuffle(pairs)
    return [PromptItem("chat", f"chat:{t}:{k}", _CHAT_TEMPLATES[k].format(t=_TOPICS[t])) for t, k in pairs[:n]]


def build_prompts(seed: int = 0, n_math_templates: int = 2700, n_chat: int = 1792,
                  n_package_docs: int = 5000) -> list[PromptItem]:
    """Every training prompt, shuffled with ``seed`` (so a run cut short still holds a mix of all sources).

    Growing a count adds prompts and keeps the earlier ones (each source draws in a fixed order), so shards of an
    earlier, smaller pool still rebuild: until 2026-12-01 the pool had 900 math templates, 1,400 chat prompts and no
    package docs."""
    items = (benchmark_training_prompts() + stdlib_prompts(seed) + code_task_prompts()
             + math_template_prompts(n_math_templates, seed) + chat_prompts(n_chat, seed)
             + package_doc_prompts(n_package_docs, seed))
    ids = [it.prompt_id for it in items]
    if len(set(ids)) != len(ids):
        raise RuntimeError("duplicate prompt ids")
    random.Random(f"prompts:{seed}").shuffle(items)
    return items
