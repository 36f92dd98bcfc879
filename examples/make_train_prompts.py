"""Generate the drafter-distillation prompt set ``examples/train_prompts.{jsonl,parquet}``.

These prompts are fed to SmolLM2-135M-Instruct to produce the target-model
completions that a speculative-decoding (EAGLE) drafter is distilled on. They
must not overlap the evaluation prompts in ``examples/prompts.jsonl``; this
script filters out and then asserts the absence of exact and near-duplicate
prompt texts (lower-cased, punctuation-stripped comparison plus token-Jaccard /
difflib similarity).

Sources
-------
1. The Python standard library of the interpreter running this script: a sorted
   walk over ``sys.stdlib_module_names`` and their subpackages (``pkgutil``),
   importing each module inside ``try/except`` with stdout/stderr captured and
   warnings silenced. Modules with import side effects or no useful public API
   are skipped (``antigravity``, ``this``, ``tkinter``, ``idlelib``,
   ``turtle``/``turtledemo``, ``readline``/``rlcompleter``, test packages,
   ``__main__`` modules, platform aliases such as ``posixpath``, and the PEP 594
   modules removed from recent Pythons). From each module we take the public
   functions, classes, exceptions and methods (``__all__`` if defined, otherwise
   names defined in that module), their signatures (``inspect.signature``) and
   docstrings (``__doc__`` via ``inspect.cleandoc``). Prompts quote at most a
   docstring's first sentence or one prose paragraph.
2. Topic, scenario, product, premise, task and sentence lists written by hand in
   this file, expanded with instruction templates (also in this file).
3. Arithmetic/algebra word problems generated from templates with numbers drawn
   from a seeded random generator.

Determinism
-----------
Every random choice uses ``random.Random`` seeded with a string derived from
``SEED`` and the item's own name, so one module failing to import elsewhere does
not perturb the other prompts. The final order is a seeded hash sort and ids
are ``t00001``, ``t00002``, ... Output is byte-identical across runs on the same
interpreter (independent of ``PYTHONHASHSEED`` and the working directory); the
stdlib part depends on the interpreter build (Python version, platform), so the
committed files record one run (CPython 3.11 on Linux). ``--from-jsonl``
rebuilds the Parquet file from the committed JSONL without regenerating anything.

Usage (from the repository root)::

    python examples/make_train_prompts.py              # regenerate jsonl + parquet
    python examples/make_train_prompts.py --from-jsonl # parquet from committed jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import inspect
import io
import json
import pkgutil
import random
import re
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from pathlib import Path
from types import ModuleType

import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
EVAL_JSONL = HERE / "prompts.jsonl"
OUT_JSONL = HERE / "train_prompts.jsonl"
OUT_PARQUET = HERE / "train_prompts.parquet"

SEED = 20241202
MIN_PROMPTS = 2000
SCHEMA = pa.schema(
    [
        pa.field("id", pa.string()),
        pa.field("category", pa.string()),
        pa.field("prompt", pa.string()),
    ]
)


def rng_for(*parts: str) -> random.Random:
    """A generator whose stream depends only on SEED and ``parts``."""
    return random.Random("|".join((str(SEED),) + parts))


def hash_key(*parts: str) -> str:
    return hashlib.sha256("|".join((str(SEED),) + parts).encode("utf-8")).hexdigest()


def pick(rng: random.Random, items: list, k: int) -> list:
    return rng.sample(items, min(k, len(items)))


# ---------------------------------------------------------------------------
# 1. Python standard library
# ---------------------------------------------------------------------------

SKIP_TOP = {
    # side effects on import, GUI, or interactive-terminal modules
    "antigravity",
    "this",
    "tkinter",
    "idlelib",
    "turtle",
    "turtledemo",
    "__hello__",
    "__phello__",
    "readline",
    "rlcompleter",
    "site",
    "ensurepip",
    "lib2to3",
    "distutils",
    # data-only packages, codecs, and platform aliases of other modules
    "pydoc_data",
    "encodings",
    "posix",
    "nt",
    "posixpath",
    "ntpath",
    "genericpath",
    "nturl2path",
    "sre_compile",
    "sre_constants",
    "sre_parse",
    "opcode",
    "msvcrt",
    "winreg",
    "winsound",
    "msilib",
    # PEP 594 "dead batteries" and other modules removed from recent Pythons
    "aifc",
    "asynchat",
    "asyncore",
    "audioop",
    "cgi",
    "cgitb",
    "chunk",
    "crypt",
    "imghdr",
    "imp",
    "mailcap",
    "nis",
    "nntplib",
    "ossaudiodev",
    "pipes",
    "smtpd",
    "sndhdr",
    "spwd",
    "sunau",
    "telnetlib",
    "uu",
    "xdrlib",
}
SKIP_PARTS = {"test", "tests", "idle_test", "__main__"}
SKIP_MODULES = {"xml.etree.cElementTree", "sqlite3.dbapi2"}  # aliases of other modules
NO_DESCEND = {"multiprocessing"}  # dozens of platform-specific internals

# Modules people use every day get more prompts than the long tail.
CORE = {
    "builtins",
    "abc",
    "argparse",
    "array",
    "asyncio",
    "base64",
    "bisect",
    "calendar",
    "collections",
    "collections.abc",
    "concurrent.futures",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "enum",
    "fnmatch",
    "fractions",
    "functools",
    "glob",
    "graphlib",
    "gzip",
    "hashlib",
    "heapq",
    "html",
    "http.client",
    "inspect",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "logging",
    "math",
    "operator",
    "os",
    "os.path",
    "pathlib",
    "pickle",
    "pprint",
    "queue",
    "random",
    "re",
    "secrets",
    "shlex",
    "shutil",
    "socket",
    "sqlite3",
    "statistics",
    "string",
    "struct",
    "subprocess",
    "sys",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "time",
    "timeit",
    "tomllib",
    "traceback",
    "types",
    "typing",
    "unicodedata",
    "unittest",
    "urllib.parse",
    "uuid",
    "warnings",
    "weakref",
    "xml.etree.ElementTree",
    "zipfile",
    "zoneinfo",
}
BUILTIN_TYPES_FOR_METHODS = {
    "str",
    "list",
    "dict",
    "set",
    "frozenset",
    "tuple",
    "bytes",
    "bytearray",
    "int",
    "float",
}


def skip_module(name: str) -> bool:
    parts = name.split(".")
    if parts[0] in SKIP_TOP or name in SKIP_MODULES:
        return True
    return any(p.startswith("_") or p in SKIP_PARTS or p.startswith("test_") for p in parts)


def safe_import(name: str) -> ModuleType | None:
    if skip_module(name):
        return None
    sink = io.StringIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            try:
                return importlib.import_module(name)
            except (Exception, SystemExit):
                return None


def walk_stdlib(max_depth: int = 3) -> list[tuple[str, ModuleType]]:
    """Sorted, depth-limited walk of the importable public stdlib modules."""
    tops = sorted(n for n in sys.stdlib_module_names if not skip_module(n))
    tops.remove("builtins")
    tops.insert(0, "builtins")  # so builtins win the de-duplication of re-exported objects
    out: list[tuple[str, ModuleType]] = []

    def visit(name: str, depth: int) -> None:
        mod = safe_import(name)
        if mod is None:
            return
        out.append((name, mod))
        if name == "os":
            out.append(("os.path", mod.path))
        path = getattr(mod, "__path__", None)
        if path is None or depth >= max_depth or name.split(".")[0] in NO_DESCEND:
            return
        for info in sorted(pkgutil.iter_modules(path), key=lambda i: i.name):
            visit(f"{name}.{info.name}", depth + 1)

    for top in tops:
        visit(top, 1)
    return out


SIG_LINE = re.compile(r"^[A-Za-z_][\w.]*\s*\(.*\)\s*(->.*)?$|^[A-Za-z_][\w.]*\s*->|^--$")
LIST_LINE = re.compile(r"^\s*([-*+]|\d+[.)]|[a-z][.)])\s")
PATHY = re.compile(r"(^|[\s\"'(])(/[A-Za-z0-9_.-]+){2,}|[A-Za-z]:\\")
BAD_WORDS = re.compile(
    r"deprecated|internal|private|undocumented|\bXXX\b|\bTODO\b|for compatibility|"
    r"do not use|helper|not recommended",
    re.I,
)
FIRST_SENT = re.compile(r"^(.+?[.!?])(?=\s+[A-Z(]|\s*$)")


def raw_doc(obj: object, own: bool = False) -> str:
    doc = (
        obj.__dict__.get("__doc__")
        if own and isinstance(obj, type)
        else getattr(obj, "__doc__", None)
    )
    return inspect.cleandoc(doc) if isinstance(doc, str) and doc.strip() else ""


def paragraphs(doc: str) -> list[tuple[str, bool]]:
    """Split a cleaned docstring into (joined text, is_prose) paragraphs."""
    out = []
    for block in re.split(r"\n\s*\n", doc):
        lines = [ln for ln in block.splitlines() if ln.strip()]
        if not lines:
            continue
        prose = not (
            SIG_LINE.match(lines[0].strip())
            or any(">>>" in ln or ln.startswith((" ", "\t")) for ln in lines)
            or any(LIST_LINE.match(ln) for ln in lines)
            or any(set(ln.strip()) <= set("-=~*") for ln in lines)
        )
        text = " ".join(ln.strip() for ln in lines)
        letters = sum(c.isalpha() or c.isspace() for c in text)
        if letters < 0.85 * len(text) or PATHY.search(text) or "0x" in text:
            prose = False
        out.append((text, prose))
    return out


def short_doc(paras: list[tuple[str, bool]]) -> str | None:
    """First sentence of the first prose paragraph, if it reads like a description."""
    for text, prose in paras[:2]:
        if not prose:
            continue
        m = FIRST_SENT.match(text)
        s = m.group(1) if m else text
        s = re.sub(r"\s+", " ", s).strip()
        if (
            20 <= len(s) <= 200
            and s[0].isupper()
            and not BAD_WORDS.search(s)
            and s.count("`") % 2 == 0
            and s.count('"') % 2 == 0
        ):
            return s if s.endswith((".", "!", "?")) else s + "."
        return None
    return None


def long_paras(paras: list[tuple[str, bool]]) -> list[str]:
    """Prose paragraphs long enough to summarise, from the start of a docstring (later
    paragraphs tend to depend on context the reader has not seen)."""
    res = []
    for text, prose in paras[:2]:
        text = re.sub(r"\s+", " ", text).strip()
        if (
            prose
            and 200 <= len(text) <= 900
            and len(re.findall(r"[.!?](\s|$)", text)) >= 2
            and text[0].isupper()
            and not BAD_WORDS.search(text)
            and not re.match(r"(These|This|They|It|Its|Example|See|Note|Otherwise)\b", text)
            and text.endswith((".", "!", "?", ")"))
        ):
            res.append(text)
    return res


def signature(obj: object) -> str | None:
    try:
        s = str(inspect.signature(obj))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    if len(s) > 80 or "<" in s or "0x" in s or s == "()":
        return None
    return s


def documented(obj: object, own: bool = False) -> tuple[str | None, list[str]]:
    """(short description, long paragraphs) of an object; nothing for deprecated APIs."""
    doc = raw_doc(obj, own)
    if re.search(r"deprecated", doc, re.I):
        return None, []
    p = paragraphs(doc)
    return short_doc(p), long_paras(p)


@dataclass
class Entity:
    kind: str  # module | function | class | exception | method
    name: str  # display name: json.dumps, str.split, sorted
    module: str
    short: str | None
    paras: list[str] = field(default_factory=list)
    sig: str | None = None


def belongs(obj: object, modname: str) -> bool:
    om = getattr(obj, "__module__", None)
    if not isinstance(om, str):
        return False
    last = modname.split(".")[-1]
    top = modname.split(".")[0]
    return (
        om == modname
        or om.startswith(modname + ".")
        or om in ("_" + last, "_" + top)
        or (modname == "os" and om == "posix")
    )


def collect_entities(modules: list[tuple[str, ModuleType]]) -> list[Entity]:
    seen: set[int] = set()
    ents: list[Entity] = []
    for modname, mod in modules:
        if id(mod) in seen:
            continue
        seen.add(id(mod))
        ents.append(Entity("module", modname, modname, *documented(mod)))
        public = getattr(mod, "__all__", None)
        if not (isinstance(public, (list, tuple)) and all(isinstance(n, str) for n in public)):
            public = None
        prefix = "" if modname == "builtins" else modname + "."
        members = vars(mod)
        # canonical names (obj.__name__ == name) before aliases such as array.ArrayType
        names = sorted(
            (n for n in members if not n.startswith("_") and (public is None or n in public)),
            key=lambda n: (getattr(members[n], "__name__", None) != n, n),
        )
        for name in names:
            obj = members[name]
            if not (inspect.isroutine(obj) or inspect.isclass(obj)) or id(obj) in seen:
                continue
            if public is None and not belongs(obj, modname):
                continue
            seen.add(id(obj))
            if inspect.isclass(obj):
                kind = "exception" if issubclass(obj, BaseException) else "class"
                ents.append(
                    Entity(kind, prefix + name, modname, *documented(obj, own=True), signature(obj))
                )
                if kind == "exception":
                    continue
                for mname in sorted(obj.__dict__):
                    meth = obj.__dict__[mname]
                    if isinstance(meth, (classmethod, staticmethod)):
                        meth = meth.__func__
                    if mname.startswith("_") or not inspect.isroutine(meth) or id(meth) in seen:
                        continue
                    seen.add(id(meth))
                    ents.append(
                        Entity("method", f"{prefix}{name}.{mname}", modname, *documented(meth))
                    )
            else:
                ents.append(
                    Entity("function", prefix + name, modname, *documented(obj), signature(obj))
                )
    return ents


Template = tuple[str, str]  # (category, format string)

FUNC_TEMPLATES: list[Template] = [
    ("programming", "Explain what `{q}` does and give a short example."),
    ("programming", "What is `{q}` used for in Python? Show a typical call."),
    ("code", "Write a short Python snippet that demonstrates `{q}`, with a comment on each line."),
    (
        "programming",
        'The Python documentation describes `{q}` like this: "{d}" Explain that in plain English '
        "for a beginner.",
    ),
    (
        "programming",
        'Which function in Python\'s `{mod}` module matches this description: "{d}" Show an '
        "example call.",
    ),
    (
        "code",
        "Write a pytest test that checks the behaviour of `{q}` on a couple of simple inputs.",
    ),
    ("programming", "What are common mistakes or pitfalls when using `{q}`?"),
    ("code", "Write a small, practical Python example that uses `{q}`, and explain the output."),
    ("code", "Write a simplified pure-Python version of `{q}` and explain how it works."),
    ("programming", "Explain `{q}` to someone who is new to Python, in three or four sentences."),
    ("programming", "In what real-world situation would you use `{q}`? Give a concrete example."),
]
SIG_TEMPLATES: list[Template] = [
    ("programming", "What do the parameters of `{q}{sig}` mean? Explain each one."),
    ("code", "Show two different ways to call `{q}{sig}`, and explain how the results differ."),
]
CLASS_TEMPLATES: list[Template] = [
    ("programming", "Explain the `{q}` class: what it represents and how to create an instance."),
    ("programming", "Give three practical use cases for `{q}`."),
    ("code", "Write a short example that creates a `{q}` object and uses it, with comments."),
    ("programming", 'The docs say `{q}` is: "{d}" What does this mean in practice?'),
    ("programming", "When should I use `{q}`, and what are the alternatives?"),
    ("code", "Write a Python class that uses `{q}` internally, and explain the design."),
]
EXC_TEMPLATES: list[Template] = [
    ("programming", "When is `{q}` raised in Python, and how should I handle it?"),
    ("code", "Write a short Python example that raises and then catches `{q}`."),
    ("programming", 'Explain this description of `{q}` in simpler words: "{d}"'),
    ("programming", "What usually causes `{q}`, and how do I debug it?"),
]
METHOD_TEMPLATES: list[Template] = [
    ("programming", "What does the `{q}` method do? Give an example."),
    ("code", "Show how to use `{q}` in a short Python example and explain the result."),
    ("programming", 'The docstring of `{q}` says: "{d}" Explain it with an example.'),
    ("programming", "When would I call `{q}`? Give a realistic example."),
]
MODULE_TEMPLATES: list[Template] = [
    ("programming", "Give an overview of Python's `{q}` module in a few bullet points."),
    (
        "programming",
        "What is the `{q}` module for, and what are three of its most useful functions or classes?",
    ),
    ("programming", "When would I reach for the `{q}` module? Give a realistic example."),
    (
        "code",
        "Write a short tutorial introduction to the `{q}` module for intermediate Python "
        "programmers, with code.",
    ),
    (
        "programming",
        'The `{q}` module is described as: "{d}" What does that mean, and when is it useful?',
    ),
]
PAIR_TEMPLATES: list[Template] = [
    ("comparison", "What is the difference between `{a}` and `{b}` in Python?"),
    ("comparison", "When would you use `{a}` instead of `{b}`? Give an example of each."),
    ("comparison", "Compare `{a}` and `{b}` in Python, with a short example of each."),
    (
        "comparison",
        "I always mix up `{a}` and `{b}`. How do they differ, and which should I use by default?",
    ),
]
# Hand-picked pairs that people genuinely confuse or choose between.
STDLIB_PAIRS = [
    ("sorted", "list.sort"),
    ("map", "a list comprehension"),
    ("repr", "str"),
    ("json.dump", "json.dumps"),
    ("os.path.abspath", "os.path.realpath"),
    ("copy.copy", "copy.deepcopy"),
    ("re.match", "re.search"),
    ("re.findall", "re.finditer"),
    ("subprocess.run", "subprocess.Popen"),
    ("collections.OrderedDict", "dict"),
    ("collections.defaultdict", "dict.setdefault"),
    ("time.time", "time.perf_counter"),
    ("time.monotonic", "time.time"),
    ("shutil.copy", "shutil.copy2"),
    ("os.remove", "shutil.rmtree"),
    ("pickle", "json"),
    ("threading", "multiprocessing"),
    ("asyncio.gather", "asyncio.wait"),
    ("functools.lru_cache", "functools.cache"),
    ("list.append", "list.extend"),
    ("dict.get", "dict.setdefault"),
    ("str.split", "str.partition"),
    ("str.strip", "str.removeprefix"),
    ("isinstance", "type"),
    ("zip", "itertools.zip_longest"),
    ("random.choice", "random.sample"),
    ("random", "secrets"),
    ("math.floor", "int"),
    ("pathlib.Path", "os.path"),
    ("glob.glob", "pathlib.Path.rglob"),
    ("heapq.nlargest", "sorted"),
    ("bisect.bisect_left", "bisect.bisect_right"),
    ("collections.namedtuple", "dataclasses.dataclass"),
    ("queue.Queue", "collections.deque"),
    ("statistics.mean", "statistics.median"),
    ("logging.info", "print"),
    ("unittest", "doctest"),
    ("csv.reader", "csv.DictReader"),
    ("struct.pack", "int.to_bytes"),
    ("hashlib.sha256", "hmac.new"),
    ("urllib.parse.quote", "urllib.parse.quote_plus"),
    ("string.Template", "str.format"),
    ("textwrap.wrap", "textwrap.fill"),
    ("os.system", "subprocess.run"),
    ("eval", "ast.literal_eval"),
    ("io.StringIO", "io.BytesIO"),
    ("concurrent.futures.ThreadPoolExecutor", "concurrent.futures.ProcessPoolExecutor"),
    ("enum.Enum", "enum.IntEnum"),
    ("abc.ABC", "typing.Protocol"),
    ("operator.itemgetter", "a lambda"),
    ("contextlib.suppress", "try/except"),
    ("functools.partial", "a lambda"),
    ("zipfile", "tarfile"),
    ("decimal.Decimal", "float"),
    ("fractions.Fraction", "decimal.Decimal"),
    ("uuid.uuid4", "uuid.uuid1"),
    ("sqlite3.Cursor.execute", "sqlite3.Cursor.executemany"),
    ("threading.Lock", "threading.RLock"),
    ("socket.socket.send", "socket.socket.sendall"),
    ("os.walk", "os.scandir"),
    ("os.makedirs", "os.mkdir"),
    ("shlex.split", "str.split"),
    ("pprint.pprint", "print"),
    ("traceback.print_exc", "logging.exception"),
    ("warnings.warn", "logging.warning"),
    ("timeit.timeit", "time.perf_counter"),
    ("tuple", "list"),
    ("set", "frozenset"),
    ("bytes", "bytearray"),
    ("range", "itertools.count"),
    ("any", "all"),
    ("datetime.datetime.now", "datetime.datetime.utcnow"),
    ("typing.Optional", "typing.Union"),
    ("asyncio.run", "asyncio.get_event_loop"),
    ("itertools.product", "itertools.permutations"),
    ("itertools.combinations", "itertools.combinations_with_replacement"),
    ("str.encode", "bytes.decode"),
]
PARA_TEMPLATES: list[Template] = [
    (
        "summarization",
        "Summarize this paragraph from the documentation of Python's `{q}` in one sentence:\n\n{p}",
    ),
    (
        "summarization",
        "Rewrite this paragraph from the `{q}` documentation in simpler words:\n\n{p}",
    ),
    (
        "summarization",
        "Here is a paragraph from the Python documentation for `{q}`. Explain it to a beginner "
        "and give an example:\n\n{p}",
    ),
    (
        "summarization",
        "Turn this description of `{q}` into a short bulleted list of key points:\n\n{p}",
    ),
    ("summarization", "What is the main idea of this text from the docs of `{q}`?\n\n{p}"),
    (
        "summarization",
        "Write two quiz questions, with answers, that test understanding of this paragraph about "
        "`{q}`:\n\n{p}",
    ),
]


def _fill(tpl: Template, **kw: str) -> tuple[str, str] | None:
    cat, fmt = tpl
    needed = set(re.findall(r"{(\w+)}", fmt))
    if any(not kw.get(k) for k in needed):
        return None
    return cat, fmt.format(**kw)


def _apply(
    rng: random.Random, templates: list[Template], n: int, **kw: str
) -> list[tuple[str, str]]:
    usable = [t for t in templates if _fill(t, **kw) is not None]
    return [r for t in pick(rng, usable, n) if (r := _fill(t, **kw)) is not None]


def stdlib_prompts(source: str = "stdlib") -> list[tuple[str, str, str]]:
    """(source, category, prompt) triples built from the standard library."""
    ents = collect_entities(walk_stdlib())
    by_mod: dict[str, list[Entity]] = {}
    for e in ents:
        by_mod.setdefault(e.module, []).append(e)
    out: list[tuple[str, str, str]] = []
    paras: list[tuple[str, str, str]] = []  # (module, entity, paragraph)
    for modname in sorted(by_mod):
        core = modname in CORE
        rng = rng_for("stdlib", modname)
        group = by_mod[modname]
        mod_ent = group[0]
        # overview prompts for well-known modules and for documented top-level ones only
        if core or ("." not in modname and mod_ent.short):
            n_mod = 2 if core else 1
            out += [
                (source, c, p)
                for c, p in _apply(rng, MODULE_TEMPLATES, n_mod, q=modname, d=mod_ent.short or "")
            ]
        documented = [e for e in group[1:] if e.short and e.kind != "method"]
        n_main = 7 if core else 1
        if modname == "builtins":
            n_main = 40
        chosen = pick(rng, documented, n_main)
        for e in sorted(chosen, key=lambda e: e.name):
            erng = rng_for("entity", e.name)
            k = 2 if modname == "builtins" else 1
            kw = {"q": e.name, "mod": modname, "d": e.short or "", "sig": e.sig or ""}
            if e.kind == "function":
                tpls = FUNC_TEMPLATES + (SIG_TEMPLATES if e.sig else [])
            elif e.kind == "class":
                tpls = CLASS_TEMPLATES
            else:
                tpls = EXC_TEMPLATES
            out += [(source, c, p) for c, p in _apply(erng, tpls, k, **kw)]
        methods = [e for e in group if e.kind == "method" and e.short]
        if modname == "builtins":
            methods = [e for e in methods if e.name.split(".")[0] in BUILTIN_TYPES_FOR_METHODS]
            n_meth = 40
        else:
            n_meth = 3 if core else int(rng.random() < 0.3)
        for e in sorted(pick(rng, methods, n_meth), key=lambda e: e.name):
            out += [
                (source, c, p)
                for c, p in _apply(
                    rng_for("entity", e.name), METHOD_TEMPLATES, 1, q=e.name, d=e.short or ""
                )
            ]
        mod_paras = [(modname, e.name, p) for e in group for p in e.paras[:1]]
        paras += pick(rng, mod_paras, 3 if core else 1)
    for a, b in STDLIB_PAIRS:
        prng = rng_for("pair", a, b)
        out += [
            (source, c, p)
            for c, p in _apply(prng, PAIR_TEMPLATES, prng.choice([1, 1, 2]), a=a, b=b)
        ]
    # cap the summarisation prompts so docs prose does not dominate the set
    paras = sorted(paras, key=lambda t: hash_key("para", t[1]))[:200]
    for _mod, ename, p in sorted(paras):
        out += [
            (source, c, q)
            for c, q in _apply(rng_for("para", ename), PARA_TEMPLATES, 1, p=p, q=ename)
        ]
    return out


# ---------------------------------------------------------------------------
# 2. Hand-written topic lists x instruction templates
# ---------------------------------------------------------------------------

SCIENCE_TOPICS = [
    "the Doppler effect",
    "plate tectonics",
    "natural selection",
    "the structure of DNA",
    "the water cycle",
    "the nitrogen cycle",
    "the Richter and moment magnitude scales",
    "the Big Bang theory",
    "superconductivity",
    "the placebo effect",
    "circadian rhythms",
    "special relativity",
    "static electricity",
    "ocean acidification",
    "the human gut microbiome",
    "volcanic eruptions",
    "the periodic table",
    "covalent and ionic bonds",
    "exoplanets",
    "the carbon cycle",
    "stem cells",
    "the ozone layer",
    "the northern lights",
    "magnetism",
    "sound waves",
    "lightning",
    "enzymes",
    "cloud formation",
    "hurricanes",
    "the Krebs cycle",
    "neuroplasticity",
    "food webs",
    "coral reefs",
    "bird migration",
    "semiconductors",
    "lasers",
    "the Higgs boson",
    "genetic mutations",
    "the scientific method",
    "allergies",
    "how the heart pumps blood",
    "how memories form in the brain",
    "soil erosion",
    "continental glaciers",
    "the life cycle of a star",
    "pH and acids and bases",
    "osmosis",
    "the electromagnetic spectrum",
    "friction",
    "convection currents",
]
HISTORY_TOPICS = [
    "the fall of Constantinople in 1453",
    "the Italian Renaissance",
    "the Industrial Revolution",
    "the Apollo 11 mission",
    "the Protestant Reformation",
    "the rise of the Ottoman Empire",
    "the Mongol Empire",
    "the American Civil War",
    "the partition of India in 1947",
    "the Cold War",
    "the invention of writing in Mesopotamia",
    "the building of the Great Wall of China",
    "the Viking Age",
    "the Aztec Empire",
    "the Inca road system",
    "the building of the Egyptian pyramids",
    "the abolition of the transatlantic slave trade",
    "the women's suffrage movement",
    "the Hundred Years' War",
    "the 1918 influenza pandemic",
    "the Dust Bowl",
    "the Great Depression",
    "the collapse of the Soviet Union",
    "the Scientific Revolution",
    "the Age of Exploration",
    "the Boston Tea Party",
    "the Congress of Vienna",
    "the unification of Germany in 1871",
    "the Tang dynasty",
    "the Mali Empire under Mansa Musa",
    "the Byzantine Empire",
    "the Crusades",
    "the American civil rights movement",
    "the Chernobyl disaster",
    "the space race",
    "the Enlightenment",
    "the Irish Great Famine",
    "the founding of the United Nations",
    "the Norman conquest of England",
    "the Haitian Revolution",
]
ECON_TECH_TOPICS = [
    "the law of diminishing returns",
    "economies of scale",
    "monopolies and antitrust law",
    "behavioral economics",
    "the gig economy",
    "cryptocurrency",
    "universal basic income",
    "minimum wage laws",
    "index funds",
    "the time value of money",
    "price elasticity of demand",
    "venture capital",
    "the tragedy of the commons",
    "game theory and the prisoner's dilemma",
    "exchange rates",
    "microfinance",
    "global supply chains",
    "the bond market",
    "the 2008 financial crisis",
    "progressive taxation",
    "the business cycle",
    "public-key cryptography",
    "machine learning",
    "neural networks",
    "large language models",
    "blockchains",
    "cloud computing",
    "software containers",
    "the Domain Name System",
    "compilers",
    "operating system kernels",
    "caching",
    "load balancing",
    "Unicode and UTF-8",
    "floating-point numbers",
    "two-factor authentication",
    "password hashing",
    "the Internet of Things",
    "open-source software licensing",
    "virtual memory",
    "functional programming",
    "object-oriented programming",
    "database indexes",
    "message queues",
    "microservices",
    "WebAssembly",
    "quantum computing",
    "speculative decoding in language models",
    "the transformer architecture",
    "recommender systems",
    "data compression",
    "error-correcting codes",
    "the halting problem",
    "Dijkstra's shortest path algorithm",
    "event loops",
    "CPU caches",
    "GPUs",
    "peer-to-peer networks",
    "continuous integration",
    "technical debt",
]
CULTURE_LIFE_TOPICS = [
    "Impressionist painting",
    "jazz improvisation",
    "the sonnet form",
    "film noir",
    "the hero's journey in storytelling",
    "Gothic architecture",
    "the Bauhaus movement",
    "opera",
    "the origins of hip-hop",
    "minimalism in design",
    "the history of chess",
    "the Japanese tea ceremony",
    "the Day of the Dead",
    "Greek mythology",
    "Norse mythology",
    "intermittent fasting",
    "mindfulness meditation",
    "strength training for beginners",
    "sleep hygiene",
    "the Mediterranean diet",
    "burnout at work",
    "vitamin D",
    "Stoic philosophy",
    "utilitarianism",
    "the trolley problem",
    "cognitive biases",
    "the Socratic method",
    "urban planning",
    "public libraries",
    "sign languages",
]
HOW_IT_WORKS = [
    "how a microwave oven heats food",
    "how a card payment is processed after you tap your card",
    "how a bill becomes a law in the United States",
    "how elevators know which floor to stop at",
    "how airplane wings create lift",
    "how a zipper works",
    "how solar panels turn sunlight into electricity",
    "how tap water is treated before it reaches a home",
    "how a search engine decides which pages to show",
    "how yeast makes bread rise",
    "how submarines dive and surface",
    "how 3D printers build objects",
    "how touchscreens detect a finger",
    "how lithium-ion batteries store energy",
    "how cheese is made",
    "how a camera lens focuses light",
    "how a compass finds north",
    "how the human ear turns sound into signals",
    "how a bicycle stays upright while moving",
    "how wind turbines generate electricity",
    "how recycling plants sort materials",
    "how QR codes store information",
    "how coffee is decaffeinated",
    "how spam filters recognise junk email",
    "how a thermostat keeps a room at a set temperature",
    "how a lock and key work",
    "how a dishwasher cleans plates",
    "how weather forecasts are made",
    "how a hybrid car switches between engine and battery",
    "how wifi routers send data through the air",
]
HOW_TEMPLATES = [
    "Explain {t}.",
    "Walk me through {t}, step by step.",
    "In a short paragraph, describe {t} for a curious teenager.",
    "Explain {t}, and mention one common misconception about it.",
]
FACT_QUESTIONS = [
    "What is the capital of Canada?",
    "Which ocean is the largest?",
    "Who wrote Pride and Prejudice?",
    "What is the hardest naturally occurring substance?",
    "How many continents are there, and what are they called?",
    "What is the chemical formula for table salt?",
    "Who developed the first polio vaccine?",
    "What is the largest organ of the human body?",
    "When did the Titanic sink?",
    "Which planet is called the Red Planet, and why?",
    "How many strings does a standard guitar have?",
    "What is the main gas in the Earth's atmosphere?",
    "Who was the first person to walk on the Moon?",
    "What is the currency of Japan?",
    "Which African country has the largest population?",
    "What does DNA stand for?",
    "What is the longest bone in the human body?",
    "Who composed The Four Seasons?",
    "What is the largest mammal on Earth?",
    "Which country gave the Statue of Liberty to the United States?",
    "In what year did World War II end?",
    "How many time zones does Russia span?",
    "What is the capital of Kenya?",
    "Who is credited with inventing the telephone?",
    "What is the highest waterfall in the world?",
    "Which metal is liquid at room temperature?",
    "What is the scientific study of earthquakes called?",
    "How many keys does a standard piano have?",
    "What is the official language of Brazil?",
    "Who wrote On the Origin of Species?",
    "What is the largest lake in Africa?",
    "What does CPU stand for?",
    "In which country is the city of Timbuktu?",
    "What is the main ingredient in guacamole?",
    "Who painted the Mona Lisa?",
    "Which star is closest to the Earth after the Sun?",
    "What is the capital of Argentina?",
    "What is the pH of pure water at 25 degrees Celsius?",
    "What is the Great Red Spot on Jupiter?",
    "How long is a marathon in kilometres?",
    "What is currently the tallest building in the world?",
    "Which language is mainly spoken in Quebec?",
    "What is the boiling point of water in kelvin?",
    "Who formulated the three laws of motion?",
    "What is the largest island in the world?",
    "What is a group of crows called?",
    "Where was paper invented?",
    "How many chambers does the human heart have?",
    "What is the capital of New Zealand?",
    "Who discovered penicillin, and how?",
    "What is absolute zero?",
    "What is the difference between latitude and longitude?",
    "Which gas do plants absorb from the air?",
    "Who was Ada Lovelace?",
    "What is the Kuiper Belt?",
    "How many teeth does an adult human usually have?",
    "What is the capital city of Vietnam?",
    "Which river flows through Cairo?",
    "What does the abbreviation NASA stand for?",
    "What are the official languages of Switzerland?",
]

PLACES = [
    "Iceland",
    "Kyoto",
    "Patagonia",
    "the Himalayas",
    "Venice",
    "Lisbon",
    "Marrakech",
    "Istanbul",
    "New Zealand's South Island",
    "the Galapagos Islands",
    "Yellowstone National Park",
    "the Dead Sea",
    "Antarctica",
    "Mongolia",
    "Cape Town",
    "Vancouver",
    "Singapore",
    "Prague",
    "Oaxaca",
    "the Scottish Highlands",
    "Hanoi",
    "Buenos Aires",
    "the Amazon rainforest",
    "the Great Barrier Reef",
    "Seoul",
]

CONCEPT_TEMPLATES = [
    ("explain", "Explain {t} in simple terms."),
    ("explain", "Give a short introduction to {t} and explain why the topic matters."),
    ("factual", "Give me three surprising facts about {t}."),
    ("explain", "Write a short paragraph explaining {t} to a high school student."),
    ("explain", "What are the most common misconceptions about {t}?"),
    ("explain", "Explain {t} using an everyday analogy."),
    ("list", "Write five quiz questions about {t}, with answers."),
    ("explain", "How would you explain {t} to a five-year-old?"),
    (
        "list",
        "List the key terms someone should know to understand {t}, with a one-line definition of "
        "each.",
    ),
    ("writing", "Write a tweet-length explanation of {t}."),
    ("writing", "Write a short, engaging introduction to {t} for a general-audience magazine."),
    ("list", "Write a short outline for a ten-minute talk about {t}."),
]
HISTORY_TEMPLATES = [
    ("history", "What were the main causes of {t}?"),
    ("history", "Describe {t} in a short paragraph."),
    ("history", "What were the long-term consequences of {t}?"),
    ("writing", "Write a diary entry from the point of view of someone who lived through {t}."),
    ("history", "Give a short timeline of the key moments of {t}."),
    ("history", "Why do historians still study {t} today?"),
    ("history", "Explain {t} to a middle-school student."),
    ("list", "Write three discussion questions for a class studying {t}."),
]
PLACE_TEMPLATES = [
    ("factual", "What is {t} known for?"),
    ("writing", "Write a short travel-guide paragraph about {t}."),
    ("advice", "Plan a three-day itinerary for a first visit to {t}."),
    ("factual", "Describe the climate and geography of {t}."),
    ("factual", "What are some lesser-known facts about {t}?"),
    ("advice", "What should a visitor know about local customs in {t}?"),
    ("writing", "Write a postcard message from someone on holiday in {t}."),
]

EMAIL_SCENARIOS = [
    "ask my manager for a day off next Friday",
    "follow up on a job application I sent two weeks ago",
    "invite my neighbors to a street cleanup on Saturday morning",
    "remind a client that an invoice is 30 days overdue",
    "thank a mentor for their career advice",
    "ask my child's teacher for feedback on their reading progress",
    "reschedule a dentist appointment",
    "request a refund for a blender that broke after a week",
    "introduce two colleagues who should work together",
    "tell my team the office will be closed for maintenance on Monday",
    "ask a professor whether I can join their research lab",
    "congratulate a friend on the birth of their baby",
    "welcome a new employee to the team",
    "cancel my gym membership",
    "ask for a raise after a successful year",
    "complain to an airline about lost luggage",
    "propose a new format for our weekly team meeting",
    "ask a contractor for a quote to renovate a small bathroom",
    "decline an invitation to speak at a conference",
    "share the results of a customer survey with stakeholders",
    "request a letter of recommendation from a former boss",
    "apologize for missing an important meeting",
    "announce a small price increase to newsletter subscribers",
    "ask my homeowners' association about installing solar panels",
    "follow up with someone I met at a networking event",
    "resign from a part-time job",
    "ask a supplier about a delayed shipment",
    "invite a guest speaker to our university's robotics club",
    "tell a client that a project milestone will slip by one week",
    "thank volunteers after a charity fun run",
    "ask IT for access to a shared drive",
    "remind the team about the deadline for expense reports",
]
EMAIL_TEMPLATES = [
    "Write a short, polite email to {t}.",
    "Write a friendly but professional email to {t}.",
    "Draft a concise email (under 100 words) to {t}.",
    "Write an email to {t}. Keep the tone warm and clear.",
]
PRODUCTS = [
    "a bamboo cutting board",
    "a solar-powered phone charger",
    "a weighted blanket",
    "a cast-iron skillet",
    "a smart thermostat",
    "a waterproof rain jacket for kids",
    "a mechanical keyboard",
    "reusable beeswax food wraps",
    "an ergonomic office chair",
    "a travel backpack with a laptop sleeve",
    "a scented soy candle",
    "a portable espresso maker",
    "a cordless drill",
    "an electric toothbrush",
    "a foldable yoga mat",
    "a handmade leather wallet",
    "a board game about space exploration",
    "a hanging herb garden kit",
    "trail running shoes",
    "an LED desk lamp with a wireless charger",
    "a language-learning app",
    "a HEPA air purifier",
    "a stainless steel lunch box",
    "a no-pull dog harness",
    "a fountain pen",
    "a compact air fryer",
    "a children's picture book about the ocean",
    "a bird feeder with a camera",
    "a set of noise-reducing earplugs",
    "an insulated camping mug",
    "a standing desk converter",
    "a sourdough bread baking kit",
    "a rechargeable bike light",
    "a linen duvet cover",
]
PRODUCT_TEMPLATES = [
    "Write a product description for {t}.",
    "Write a 50-word product description for {t} for an online store.",
    "Write a playful product description for {t}.",
    "Write three bullet points highlighting the features of {t}.",
    "Write a short, honest customer review of {t}.",
    "Write an Instagram caption promoting {t}.",
]
POEM_SUBJECTS = [
    "a rainy Monday morning",
    "an old oak tree",
    "the ocean at dawn",
    "a cup of tea",
    "moving to a new home",
    "a lighthouse keeper",
    "the last day of summer",
    "a busy train station",
    "friendship",
    "the moon over a quiet lake",
    "learning to ride a bike",
    "a forgotten umbrella",
    "the smell of coffee",
    "mountains at sunrise",
    "a summer thunderstorm",
    "cherry blossoms",
    "a cat asleep in the sun",
    "an old library",
    "a grandmother's kitchen",
    "the stars over the desert",
    "an early morning run",
    "a garden in winter",
    "a paper boat",
    "a lost glove",
    "the first day of school",
    "a jar of fireflies",
    "a long train journey",
    "the sound of rain on a tin roof",
    "a bakery at 5 am",
    "a tide pool",
]
POEM_TEMPLATES = [
    "Write a haiku about {t}.",
    "Write a limerick about {t}.",
    "Write a four-line rhyming poem about {t}.",
    "Write a short free-verse poem about {t}.",
    "Write a sonnet about {t}.",
    "Write two haiku about {t}.",
]
STORY_PREMISES = [
    "a robot that learns to paint",
    "a detective who can't remember yesterday",
    "a village where it never stops raining",
    "two strangers stuck in an elevator",
    "a time traveler who always arrives one day late",
    "a child who finds a map hidden in a library book",
    "a lighthouse that starts sending messages",
    "a chef who loses their sense of taste",
    "the last bookstore on Mars",
    "a dog who runs for mayor",
    "an astronaut who hears music on the far side of the Moon",
    "a letter delivered fifty years late",
    "a town where everyone swaps jobs for a day",
    "a shy dragon who wants to be a baker",
    "a musician who can only play one song",
    "a garden that grows whatever you whisper to it",
    "a night-shift janitor in a natural history museum",
    "a phone that receives calls from the future",
    "twins separated at birth who meet at a chess tournament",
    "a mapmaker who draws a city that doesn't exist",
    "a ghost who is afraid of people",
    "the first day at a school for wizards, told by the cafeteria cook",
]
STORY_TEMPLATES = [
    "Write a short story (under 300 words) about {t}.",
    "Write the opening paragraph of a story about {t}.",
    "Write a six-sentence story about {t}.",
    "Outline the plot of a short story about {t}.",
    "Write a short scene of dialogue about {t}.",
]
CODE_TASKS = [
    "reverses the order of words in a sentence",
    "counts the vowels in a string",
    "returns the factorial of n",
    "checks whether a number is prime",
    "finds the longest common prefix of a list of strings",
    "converts a temperature from Celsius to Fahrenheit",
    "returns the n-th Fibonacci number iteratively",
    "removes all whitespace from a string",
    "returns the key with the largest value in a dictionary",
    "computes the greatest common divisor of two integers",
    "capitalizes the first letter of every word in a string",
    "returns the intersection of two lists",
    "rotates a list to the right by k positions",
    "counts the number of lines in a text file",
    "converts a camelCase string to snake_case",
    "finds the missing number in a list containing 1 to n with one number missing",
    "checks whether the brackets in a string are balanced",
    "returns the running total of a list of numbers",
    "transposes a matrix given as a list of lists",
    "groups a list of words by their first letter",
    "returns the weekday name for a date string like 2024-03-15",
    "generates a random password of a given length",
    "implements a stack with push, pop, and peek",
    "returns the most common character in a string",
    "run-length encodes a string, turning aaabbc into a3b2c1",
    "merges two dictionaries, summing the values of shared keys",
    "finds all pairs of numbers in a list that add up to a target",
    "converts a non-negative integer to a binary string without built-ins",
    "sorts a list of (name, age) tuples by age",
    "implements a small LRU cache",
    "computes the median of a list of numbers",
    "checks whether a year is a leap year",
    "returns the digits of an integer as a list",
    "finds the longest word in a sentence",
    "computes the dot product of two vectors",
    "checks whether a list is sorted in ascending order",
    "implements insertion sort",
    "implements quicksort",
    "implements a queue using two stacks",
    "finds the first non-repeating character in a string",
    "formats a number of seconds as HH:MM:SS",
    "retries a function up to three times if it raises an exception",
    "counts how many times each word appears in a sentence",
    "returns every k-th element of a list",
    "converts a list of key-value pairs into a dictionary",
    "checks whether a string contains only digits",
    "computes the sum of the squares of the numbers from 1 to n",
    "finds the index of the minimum element in a list",
    "clamps a number to a given range",
    "returns the Hamming distance between two equal-length strings",
]
LANGUAGES = ["Python"] * 5 + ["JavaScript", "JavaScript", "TypeScript", "Go", "Rust", "Java", "C++"]
CODE_TEMPLATES = [
    "Write a {lang} function that {t}.",
    "Write a {lang} function that {t}. Include a few example calls.",
    "How would you write a {lang} function that {t}? Explain your approach briefly.",
    "Write a {lang} function that {t}, and state its time complexity.",
    "Write a {lang} function that {t}, along with unit tests.",
]
SQL_TASKS = [
    "lists all customers who have never placed an order, given tables customers(id, name) and "
    "orders(id, customer_id, created_at)",
    "computes total revenue per month from a table sales(id, amount, sold_at)",
    "finds the three most recent orders for each customer in orders(id, customer_id, created_at)",
    "returns the average rating per product from reviews(product_id, rating), only for products "
    "with at least 10 reviews",
    "finds employees who earn more than their manager, given employees(id, name, salary, "
    "manager_id)",
    "counts daily active users from events(user_id, event_time)",
    "deletes duplicate rows from contacts(id, email), keeping the row with the smallest id",
    "ranks students by score within each class, given scores(student_id, class_id, score)",
    "finds products that were never sold, given products(id, name) and order_items(order_id, "
    "product_id)",
    "computes a 7-day moving average of daily sales from daily_sales(day, total)",
    "finds the busiest hour of the day from visits(id, visited_at)",
    "lists authors with more than five books, given authors(id, name) and books(id, author_id, "
    "title)",
    "updates the status of all orders older than 30 days to 'archived' in orders(id, status, "
    "created_at)",
    "calculates each department's share of total payroll from employees(id, department, salary)",
]
SQL_TEMPLATES = [
    "Write a SQL query that {t}.",
    "Write a SQL query that {t}, and explain how it works.",
    "Write a PostgreSQL query that {t}.",
]
SHELL_TASKS = [
    "counts the lines in all .py files under the current directory",
    "finds the 10 largest files in a directory tree",
    "renames every .jpeg file in a folder to .jpg",
    "shows which process is listening on port 8080",
    "deletes files older than 30 days from a scratch folder",
    "prints the 20 most frequent IP addresses in an access log",
    "backs up a folder to a timestamped tar.gz archive",
    "replaces a word in every .txt file in a directory",
    "watches a log file and prints lines containing ERROR",
    "checks disk usage and warns when a partition is more than 90% full",
]
SHELL_TEMPLATES = [
    "Write a bash command that {t}.",
    "Write a small bash script that {t}, with comments.",
    "How do I write a shell one-liner that {t}? Explain each part.",
]
COMPARISON_PAIRS = [
    ("Python", "Go for backend services"),
    ("cats", "dogs as pets"),
    ("green tea", "black coffee"),
    ("nuclear power", "solar power"),
    ("index funds", "individual stocks"),
    ("a Roth IRA", "a traditional IRA"),
    ("Linux", "Windows for software development"),
    ("Kafka", "RabbitMQ"),
    ("React", "Vue"),
    ("REST", "GraphQL"),
    ("SSDs", "hard disk drives"),
    ("Stoicism", "Epicureanism"),
    ("classical conditioning", "operant conditioning"),
    ("leasing a car", "buying a car"),
    ("running", "cycling for fitness"),
    ("Spanish", "French as a second language for English speakers"),
    ("Impressionism", "Expressionism"),
    ("the Roman Republic", "the Roman Empire"),
    ("DSLR cameras", "mirrorless cameras"),
    ("freelancing", "full-time employment"),
    ("hurricanes", "tornadoes"),
    ("white rice", "brown rice"),
    ("LED bulbs", "incandescent bulbs"),
    ("the violin", "the viola"),
    ("AC", "DC electricity"),
    ("arrays", "linked lists"),
    ("threads", "async/await in Python"),
    ("static typing", "dynamic typing"),
    ("compiled languages", "interpreted languages"),
    ("Vim", "Emacs"),
    ("frogs", "toads"),
    ("butter", "margarine"),
    ("public schools", "private schools"),
    ("term life insurance", "whole life insurance"),
    ("credit cards", "debit cards"),
    ("vacation rentals", "hotels"),
    ("trains", "planes for travel within Europe"),
    ("Markdown", "reStructuredText"),
    ("JSON", "YAML"),
    ("CSV", "Parquet"),
    ("HTTP/2", "HTTP/3"),
    ("monoliths", "microservices"),
    ("a gas stove", "an induction cooktop"),
    ("e-bikes", "scooters for commuting"),
    ("Kotlin", "Java for Android apps"),
    ("tennis", "badminton"),
    ("the Iliad", "the Odyssey"),
]
COMPARISON_TEMPLATES = [
    "Compare {a} and {b}.",
    "What are the main differences between {a} and {b}?",
    "Make a short table comparing {a} and {b}.",
    "Which is better for a beginner, {a} or {b}? Explain the trade-offs.",
    "Give two advantages and two disadvantages each of {a} and {b}.",
]
ADVICE_GOALS = [
    "learn to cook healthy meals on a budget",
    "become a better listener",
    "negotiate a higher salary",
    "get started with indoor rock climbing",
    "learn touch typing",
    "keep a journal consistently",
    "prepare for a long-haul flight",
    "help my kid with math homework without doing it for them",
    "write better commit messages",
    "read more books this year",
    "stay calm during exam season",
    "stop procrastinating on big projects",
    "learn to play the guitar as an adult",
    "improve my credit score",
    "plan a wedding on a tight budget",
    "take better photos with my phone",
    "grow tomatoes on a balcony",
    "speak up more in meetings",
    "get my car ready for winter",
    "give constructive feedback to a peer",
    "learn a new programming language quickly",
    "get my email inbox under control",
    "teach my dog to walk on a loose leash",
    "declutter my home",
    "host a dinner party for eight people",
    "start a small online business",
    "drink more water during the day",
    "prepare for an interview at a startup",
    "onboard a new hire remotely",
    "choose a laptop for programming",
    "write a strong resume",
    "learn to swim as an adult",
    "save for a house deposit",
    "run effective one-on-one meetings",
    "memorize a speech",
    "get better at chess",
    "reduce food waste at home",
    "set up a simple home network",
]
ADVICE_TEMPLATES = [
    "How can I {t}?",
    "Give me practical tips to {t}.",
    "What are common mistakes people make when they try to {t}?",
    "I want to {t}. Where should I start?",
    "Make a four-week plan to help me {t}.",
]
IDEA_TOPICS = [
    "a middle-school science fair project",
    "a small business I can run from home",
    "a birthday party for a seven-year-old",
    "team-building activities for a remote team",
    "blog posts about personal finance",
    "weekend trips from a big city without a car",
    "vegetarian packed lunches",
    "a five-minute short film",
    "names for a neighborhood coffee shop",
    "questions to ask at the end of a job interview",
    "ways to practice gratitude",
    "episodes of a podcast about local history",
    "hobbies that cost almost nothing",
    "a mobile app that helps university students",
    "board games for two players",
    "a community event in a park",
    "a capstone project for a data science course",
    "low-maintenance pets for a small apartment",
]
IDEA_TEMPLATES = [
    "Give me ten ideas for {t}.",
    "Brainstorm five creative ideas for {t}.",
    "List seven ideas for {t}, with one sentence about each.",
]
MESSY_SENTENCES = [
    "their going to the park tomorow if it dont rain",
    "I has been working here since three years",
    "the datas shows that sales has increased alot",
    "me and my friend was late becuase the bus didnt came",
    "she dont know nothing about the meeting",
    "who's book is this, its been left on my desk",
    "we should of left earlier, now were stuck in trafic",
    "the team have finished there report but it need more editting",
    "everyone of the students have submitted they're homework",
    "less people came to the event then we expected",
    "i seen that movie allready, it was more better than the book",
    "the results was suprising for everybody who were there",
]
CASUAL_MESSAGES = [
    "hey, can u send me the slides before the call? thx",
    "sorry im running late, traffic is insane, be there in 20",
    "the server's down again lol, someone pls look at it",
    "cant make it tmrw, something came up, can we do thurs?",
    "yo the numbers in the report look off, did someone change the formula?",
    "just fyi the client hated the new logo",
    "we're totally out of coffee in the kitchen, who's on supplies this week??",
    "btw the deadline got moved up to friday, sorry!!",
    "did anyone grab my charger from the meeting room",
    "the wifi is super slow today, anyone else?",
]
EDIT_TEMPLATES = [
    ("editing", 'Fix the grammar and spelling in this sentence: "{t}"'),
    ("editing", 'Correct this sentence and explain each change: "{t}"'),
]
TONE_TEMPLATES = [
    ("editing", 'Rewrite this message so it sounds professional: "{t}"'),
    ("editing", 'Rewrite this chat message as a polite email: "{t}"'),
    ("editing", 'Make this message more formal without changing its meaning: "{t}"'),
]
PHRASES = [
    "Could you tell me how to get to the museum?",
    "I would like a table for two, please.",
    "What time does the pharmacy close?",
    "Thank you very much for your help.",
    "My suitcase did not arrive.",
    "Is this seat taken?",
    "I am allergic to peanuts.",
    "How much does this cost?",
    "The meeting has been postponed until next week.",
    "Happy birthday! I hope all your wishes come true.",
    "Can I pay by card?",
    "Please speak more slowly.",
    "We are looking for a quiet hotel near the beach.",
]
TARGET_LANGS = ["French", "Spanish", "German", "Italian", "Portuguese", "Japanese", "Dutch"]


def _topic_prompts(
    source: str, items: list[str], templates: list[tuple[str, str]], per_item: int, default_cat: str
) -> list[tuple[str, str, str]]:
    """Each item gets ``per_item`` distinct templates; category "explain" means ``default_cat``."""
    out = []
    for t in items:
        rng = rng_for(source, t)
        for cat, fmt in pick(rng, templates, per_item):
            out.append((source, default_cat if cat == "explain" else cat, fmt.format(t=t)))
    return out


def _plain(
    source: str, cat: str, items: list[str], templates: list[str], per_item: int
) -> list[tuple[str, str, str]]:
    return [
        (source, cat, fmt.format(t=t))
        for t in items
        for fmt in pick(rng_for(source, t), templates, per_item)
    ]


def general_prompts() -> list[tuple[str, str, str]]:
    out: list[tuple[str, str, str]] = []
    out += _topic_prompts("science", SCIENCE_TOPICS, CONCEPT_TEMPLATES, 4, "science")
    out += _topic_prompts("history", HISTORY_TOPICS, HISTORY_TEMPLATES, 4, "history")
    out += _topic_prompts("econ_tech", ECON_TECH_TOPICS[:21], CONCEPT_TEMPLATES, 4, "economics")
    out += _topic_prompts("econ_tech", ECON_TECH_TOPICS[21:], CONCEPT_TEMPLATES, 4, "programming")
    out += _topic_prompts("culture", CULTURE_LIFE_TOPICS, CONCEPT_TEMPLATES, 3, "factual")
    out += _topic_prompts("places", PLACES, PLACE_TEMPLATES, 4, "factual")
    out += _plain("how", "science", HOW_IT_WORKS, HOW_TEMPLATES, 2)
    out += [("facts", "factual", q) for q in FACT_QUESTIONS]
    out += _plain("email", "writing", EMAIL_SCENARIOS, EMAIL_TEMPLATES, 2)
    out += _plain("product", "writing", PRODUCTS, PRODUCT_TEMPLATES, 2)
    out += _plain("poem", "writing", POEM_SUBJECTS, POEM_TEMPLATES, 2)
    out += _plain("story", "writing", STORY_PREMISES, STORY_TEMPLATES, 2)
    for task in CODE_TASKS:
        rng = rng_for("code", task)
        for fmt in pick(rng, CODE_TEMPLATES, 3):
            out.append(("code", "code", fmt.format(lang=rng.choice(LANGUAGES), t=task)))
    out += _plain("sql", "code", SQL_TASKS, SQL_TEMPLATES, 2)
    out += _plain("shell", "code", SHELL_TASKS, SHELL_TEMPLATES, 1)
    for a, b in COMPARISON_PAIRS:
        for fmt in pick(rng_for("compare", a, b), COMPARISON_TEMPLATES, 2):
            out.append(("compare", "comparison", fmt.format(a=a, b=b)))
    out += _plain("advice", "advice", ADVICE_GOALS, ADVICE_TEMPLATES, 3)
    out += _plain("ideas", "list", IDEA_TOPICS, IDEA_TEMPLATES, 2)
    out += _topic_prompts("edit", MESSY_SENTENCES, EDIT_TEMPLATES, 1, "editing")
    out += _topic_prompts("tone", CASUAL_MESSAGES, TONE_TEMPLATES, 2, "editing")
    for phrase in PHRASES:
        rng = rng_for("translate", phrase)
        for lang in pick(rng, TARGET_LANGS, 3):
            out.append(("translate", "editing", f'Translate "{phrase}" into {lang}.'))
    return out


# ---------------------------------------------------------------------------
# 3. Generated arithmetic / algebra word problems
# ---------------------------------------------------------------------------

NAMES = [
    "Ana",
    "Ben",
    "Chloe",
    "Dev",
    "Elif",
    "Farid",
    "Grace",
    "Hiro",
    "Ines",
    "Jamal",
    "Kofi",
    "Lena",
    "Mateo",
    "Nadia",
    "Omar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sam",
    "Tariq",
    "Uma",
    "Victor",
    "Wen",
    "Yara",
]
SUFFIXES = ["", " Show your work.", " Explain each step.", " Give the answer and a one-line check."]


def _m_speed(r: random.Random) -> str:
    h = r.choice([1.5, 2, 2.5, 3, 4, 5])
    v = r.randrange(40, 121, 5)
    return f"A car travels {v * h:g} km in {h:g} hours. What is its average speed in km/h?"


def _m_arrival(r: random.Random) -> str:
    hh, mm, dur = r.randint(9, 21), r.choice([0, 10, 15, 25, 40, 45, 50]), r.randrange(85, 200, 5)
    what = r.choice(["A movie", "A concert", "A board meeting", "A soccer tournament"])
    return f"{what} starts at {hh:02d}:{mm:02d} and lasts {dur} minutes. At what time does it end?"


def _m_discount(r: random.Random) -> str:
    item = r.choice(["jacket", "pair of boots", "lamp", "backpack", "blender", "bookshelf"])
    return (
        f"A {item} costs ${r.randrange(20, 300, 5)}. It is on sale for "
        f"{r.choice([10, 15, 20, 30, 35, 40])}% off. What is the sale price?"
    )


def _m_percent_change(r: random.Random) -> str:
    a = r.randrange(20, 200, 4)
    b = a + r.choice([-1, 1]) * r.randrange(2, a // 2, 2)
    thing = r.choice(
        [
            "a monthly bus pass",
            "a loaf of bread",
            "a concert ticket",
            "a gallon of milk",
            "a streaming subscription",
        ]
    )
    return f"The price of {thing} went from ${a} to ${b}. What is the percentage change?"


def _m_interest(r: random.Random) -> str:
    p, rate, t = r.randrange(500, 10001, 250), r.choice([2, 3, 3.5, 4, 5, 6]), r.randint(2, 8)
    if r.random() < 0.5:
        return f"How much simple interest does ${p} earn at {rate:g}% per year over {t} years?"
    return (
        f"If {r.choice(NAMES)} deposits ${p} at {rate:g}% interest compounded annually, how much "
        f"will be in the account after {t} years?"
    )


def _m_geometry(r: random.Random) -> str:
    k = r.randint(0, 3)
    if k == 0:
        return (
            f"A rectangular garden is {r.randint(4, 30)} m long and {r.randint(3, 20)} m wide. "
            f"What are its area and perimeter?"
        )
    if k == 1:
        return (
            f"A triangle has a base of {r.randint(3, 25)} cm and a height of {r.randint(3, 25)} "
            f"cm. What is its area?"
        )
    if k == 2:
        return (
            f"A round pond is {r.randint(2, 40)} m across. How long is a path that goes once "
            f"around its edge?"
        )
    a, b = r.choice([(3, 4), (5, 12), (8, 15), (6, 8), (9, 12), (7, 24)])
    return f"A right triangle has legs of {a} cm and {b} cm. How long is the hypotenuse?"


def _m_mean(r: random.Random) -> str:
    xs = [r.randint(55, 100) for _ in range(r.randint(4, 7))]
    return (
        f"{r.choice(NAMES)}'s test scores are {', '.join(map(str, xs))}. What are the mean and "
        f"the median?"
    )


def _m_ratio(r: random.Random) -> str:
    a, b = r.choice([(1, 2), (2, 3), (3, 5), (1, 4), (4, 5), (3, 7)])
    total = (a + b) * r.randint(5, 60)
    n1, n2 = r.sample(NAMES, 2)
    return f"{n1} and {n2} share ${total} in the ratio {a}:{b}. How much does each person get?"


def _m_work(r: random.Random) -> str:
    a, b = r.sample([2, 3, 4, 5, 6, 8, 10, 12], 2)
    n1, n2 = r.sample(NAMES, 2)
    job = r.choice(
        ["paint a fence", "mow a large lawn", "clean an office", "assemble a bookshelf order"]
    )
    return (
        f"{n1} can {job} in {a} hours, and {n2} can do it in {b} hours. How long does it take if "
        f"they work together?"
    )


def _m_convert(r: random.Random) -> str:
    k = r.randint(0, 3)
    if k == 0:
        return f"Convert {r.randint(3, 60)} miles to kilometres."
    if k == 1:
        return (
            f"How many seconds are there in {r.randint(2, 9)} hours and {r.randint(1, 59)} minutes?"
        )
    if k == 2:
        return (
            f"A cyclist rides at {r.randint(12, 40)} km/h. What is that speed in metres per second?"
        )
    return (
        f"A map has a scale of 1:{r.choice([25000, 50000, 100000, 250000])}. Two villages are "
        f"{r.randint(2, 19)}.{r.randint(0, 9)} cm apart on the map. How far apart are they in "
        f"reality?"
    )


def _m_linear(r: random.Random) -> str:
    a, x = r.randint(2, 12), r.randint(-10, 15)
    b = r.randint(-20, 30)
    sign = "+" if b >= 0 else "-"
    return f"Find the value of x that makes {a}x {sign} {abs(b)} equal to {a * x + b}."


def _m_ages(r: random.Random) -> str:
    child, k, years = r.randint(4, 15), r.randint(2, 4), r.randint(3, 12)
    n1, n2 = r.sample(NAMES, 2)
    return (
        f"{n1} is {k} times as old as {n2}. In {years} years, the sum of their ages will be "
        f"{(k + 1) * child + 2 * years}. How old is each of them now?"
    )


def _m_probability(r: random.Random) -> str:
    red, blue, green = r.randint(2, 9), r.randint(2, 9), r.randint(1, 6)
    if r.random() < 0.5:
        return (
            f"A jar has {red} red, {blue} blue, and {green} green marbles. If you pick one at "
            f"random, what is the probability it is not blue?"
        )
    return (
        f"A drawer holds {red} black socks and {blue} white socks. If you pull out two socks in "
        "the dark, what is the probability that they match?"
    )


def _m_change(r: random.Random) -> str:
    n, k, p, q = (
        r.choice(NAMES),
        r.randint(2, 6),
        r.choice([1.25, 2.5, 3.75, 4.2, 0.9]),
        r.choice([0.85, 1.5, 2.1]),
    )
    bill = 20 if k * p + q < 20 else 50
    return (
        f"{n} buys {k} notebooks at ${p:.2f} each and a pen for ${q:.2f}, and pays with a ${bill} "
        f"bill. How much change does {n} get?"
    )


def _m_consecutive(r: random.Random) -> str:
    n, k = r.randint(5, 80), r.choice([3, 4, 5])
    kind = r.choice(["consecutive integers", "consecutive even integers"])
    step = 2 if "even" in kind else 1
    start = n * step if step == 2 else n
    return (
        f"The sum of {k} {kind} is {sum(start + i * step for i in range(k))}. What are the "
        f"integers?"
    )


def _m_quadratic(r: random.Random) -> str:
    p, q = r.randint(-9, 9), r.randint(-9, 9)
    b, c = -(p + q), p * q
    bs = f"{'+' if b >= 0 else '-'} {abs(b)}x " if b else ""
    cs = f"{'+' if c >= 0 else '-'} {abs(c)}" if c else ""
    return " ".join(f"Solve x^2 {bs}{cs} = 0 by factoring.".split())


def _m_calculus(r: random.Random) -> str:
    a, b, c = r.randint(1, 7), r.randint(-9, 9), r.randint(-9, 9)
    f = f"{a}x^3 {'+' if b >= 0 else '-'} {abs(b)}x^2 {'+' if c >= 0 else '-'} {abs(c)}x"
    return r.choice(
        [
            f"Differentiate y = {f} with respect to x.",
            f"Compute the antiderivative of {f} with respect to x.",
        ]
    )


MATH_GENERATORS: list[Callable[[random.Random], str]] = [
    _m_speed,
    _m_arrival,
    _m_discount,
    _m_percent_change,
    _m_interest,
    _m_geometry,
    _m_mean,
    _m_ratio,
    _m_work,
    _m_convert,
    _m_linear,
    _m_ages,
    _m_probability,
    _m_change,
    _m_consecutive,
    _m_quadratic,
    _m_calculus,
]


def math_prompts(per_generator: int = 16) -> list[tuple[str, str, str]]:
    out = []
    for gen in MATH_GENERATORS:
        rng = rng_for("math", gen.__name__)
        for _ in range(per_generator):
            out.append(("math", "math", gen(rng) + rng.choice(SUFFIXES)))
    return out


# ---------------------------------------------------------------------------
# Overlap checks, output
# ---------------------------------------------------------------------------


def normalize(text: str) -> str:
    return " ".join(re.sub(r"[^0-9a-z]+", " ", text.lower()).split())


def near_duplicate(a: str, b: str, ta: set[str], tb: set[str]) -> bool:
    """Exact match after normalisation, or very similar wording."""
    if a == b:
        return True
    union = len(ta | tb)
    jac = len(ta & tb) / union if union else 1.0
    if jac >= 0.8:
        return True
    return jac >= 0.5 and SequenceMatcher(None, a, b, autojunk=False).ratio() >= 0.85


class EvalIndex:
    def __init__(self, texts: Iterable[str]) -> None:
        self.items = [(n, set(n.split())) for n in map(normalize, texts)]
        self.exact = {n for n, _ in self.items}

    def clashes(self, text: str) -> bool:
        n = normalize(text)
        if n in self.exact:
            return True
        toks = set(n.split())
        return any(
            near_duplicate(n, e, toks, et)
            for e, et in self.items
            if len(toks & et) * 2 >= len(toks | et)
        )


def load_eval_prompts(path: Path = EVAL_JSONL) -> list[str]:
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line)["prompt"] for line in fh if line.strip()]


def build_rows() -> tuple[list[dict[str, str]], Counter, int]:
    raw = stdlib_prompts() + general_prompts() + math_prompts()
    index = EvalIndex(load_eval_prompts())
    seen: set[str] = set()
    kept: list[tuple[str, str, str]] = []
    dropped = 0
    for source, cat, prompt in raw:
        n = normalize(prompt)
        if n in seen:
            continue
        if index.clashes(prompt):
            dropped += 1
            continue
        seen.add(n)
        kept.append((source, cat, prompt))
    kept.sort(key=lambda t: hash_key("order", t[2]))
    rows = [{"id": f"t{i:05d}", "category": c, "prompt": p} for i, (_, c, p) in enumerate(kept, 1)]
    return rows, Counter(s for s, _, _ in kept), dropped


def write_jsonl(rows: list[dict[str, str]], path: Path) -> None:
    with path.open("w", encoding="utf-8", newline="\n") as fh:
        for r in rows:
            fh.write(
                json.dumps(
                    {"id": r["id"], "category": r["category"], "prompt": r["prompt"]},
                    ensure_ascii=False,
                )
                + "\n"
            )


def read_jsonl(path: Path) -> list[dict[str, str]]:
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def validate(rows: list[dict[str, str]], eval_prompts: list[str]) -> None:
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "duplicate ids"
    assert all(re.fullmatch(r"t\d{5}", i) for i in ids), "bad id format"
    assert len(rows) >= MIN_PROMPTS, f"only {len(rows)} prompts"
    assert all(r["prompt"].strip() and r["category"] for r in rows), "empty field"
    assert not any(re.search(r"[\x00-\x09\x0b-\x1f\x7f]", r["prompt"]) for r in rows), (
        "control characters"
    )
    norms = [normalize(r["prompt"]) for r in rows]
    assert len(norms) == len(set(norms)), "duplicate training prompts"
    index = EvalIndex(eval_prompts)
    shared = [r["prompt"] for r in rows if index.clashes(r["prompt"])]
    assert not shared, f"{len(shared)} training prompts duplicate eval prompts, e.g. {shared[:3]}"


def write_parquet(rows: list[dict[str, str]], path: Path) -> None:
    table = pa.Table.from_pydict({k: [r[k] for r in rows] for k in SCHEMA.names}, schema=SCHEMA)
    pq.write_table(table, path, compression="zstd")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--from-jsonl",
        action="store_true",
        help="rebuild the parquet from the committed train_prompts.jsonl instead of regenerating",
    )
    args = ap.parse_args(argv)
    eval_prompts = load_eval_prompts()
    if args.from_jsonl:
        rows = read_jsonl(OUT_JSONL)
        validate(rows, eval_prompts)
        print(f"read {len(rows)} prompts from {OUT_JSONL.name}")
    else:
        rows, sources, dropped = build_rows()
        validate(rows, eval_prompts)
        write_jsonl(rows, OUT_JSONL)
        print(f"generated {len(rows)} prompts (dropped {dropped} that overlapped the eval set)")
        for s, n in sorted(sources.items(), key=lambda kv: (-kv[1], kv[0])):
            print(f"  source {s:<10} {n}")
    write_parquet(rows, OUT_PARQUET)
    for c, n in sorted(
        Counter(r["category"] for r in rows).items(), key=lambda kv: (-kv[1], kv[0])
    ):
        print(f"  category {c:<14} {n}")
    print(f"wrote {OUT_PARQUET.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
