"""A real English sentence set with no download: the first sentences of the docstrings of Python's standard library.

    from sentences import sentence_split
    calibration, evaluation = sentence_split(calibration=128, evaluation=512)

    python benchmarks/sentences.py            # how many sentences this Python yields, and a sample

Every machine with Python has these docstrings. The set is deterministic for a given Python version (docstrings
change a little between versions): a fixed module list; each module's docstring and those of its public functions,
classes and their public methods; the first sentence of each (up to the first ". " of the first paragraph); kept if
it reads as prose (FILTERS); whitespace collapsed, exact duplicates dropped, sorted. The split orders the sentences
by the CRC-32 of their text (a fixed pseudo-random order, unlike the alphabetical one where "Return ..." sentences
bunch together) and cuts it: the calibration and evaluation parts are disjoint.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import warnings
import zlib

# Pure-Python modules present from 3.10 to 3.13 (none deprecated for removal, none needing tkinter or a network);
# a module missing from some build is skipped.
MODULES = (
    "argparse", "ast", "asyncio", "base64", "bdb", "bisect", "calendar", "cmd", "code", "codecs", "collections",
    "colorsys", "concurrent.futures", "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime",
    "decimal", "difflib", "dis", "doctest", "email", "email.message", "email.utils", "enum", "filecmp", "fileinput",
    "fnmatch", "fractions", "ftplib", "functools", "getopt", "getpass", "gettext", "glob", "gzip", "hashlib", "heapq",
    "hmac", "html", "html.parser", "http.client", "http.cookiejar", "http.server", "imaplib", "inspect",
    "ipaddress", "json", "linecache", "locale", "logging", "logging.handlers", "lzma", "mailbox", "mimetypes",
    "modulefinder", "multiprocessing", "netrc", "numbers", "opcode", "operator", "optparse", "os", "pathlib", "pdb",
    "pickle", "pickletools", "pkgutil", "platform", "plistlib", "poplib", "pprint", "profile", "pstats", "py_compile",
    "pyclbr", "pydoc", "queue", "quopri", "random", "re", "reprlib", "rlcompleter", "runpy", "sched", "secrets",
    "selectors", "shelve", "shlex", "shutil", "signal", "site", "smtplib", "socket", "socketserver", "sqlite3",
    "ssl", "stat", "statistics", "string", "stringprep", "struct", "subprocess", "symtable", "sysconfig", "tabnanny",
    "tarfile", "tempfile", "textwrap", "threading", "timeit", "token", "tokenize", "trace", "traceback",
    "tracemalloc", "types", "typing", "unittest", "unittest.mock", "urllib.parse", "urllib.request",
    "urllib.robotparser", "uuid", "warnings", "wave", "weakref", "webbrowser", "wsgiref.handlers", "xml.dom.minidom",
    "xml.etree.ElementTree", "xml.sax", "xmlrpc.client", "zipapp", "zipfile",
)

MIN_CHARS, MAX_CHARS = 40, 200
MIN_WORDS = 6
# prose: a capital first letter, a final period, no code (brackets, =, `, >>>, ::, backslashes, a dotted.name()),
# and mostly letters and spaces
PROSE = re.compile(r"[A-Z][a-z]+ [^\[\]{}=`<>|\\#@]*\.")
CODE = re.compile(r"\w\(|\w\.\w|::|--|\s_")
MIN_LETTER_SHARE = 0.85


def first_sentence(doc: str) -> str | None:
    """The first sentence of a docstring's first paragraph, whitespace collapsed, if it reads as prose; else None."""
    paragraph = " ".join(doc.strip().split("\n\n", 1)[0].split())
    sentence = re.split(r"(?<=[a-z)]\.)\s", paragraph, maxsplit=1)[0]
    if not (MIN_CHARS <= len(sentence) <= MAX_CHARS and PROSE.fullmatch(sentence) and not CODE.search(sentence)):
        return None
    if len(sentence.split()) < MIN_WORDS:
        return None
    letters = sum(c.isalpha() or c == " " for c in sentence)
    return sentence if letters / len(sentence) >= MIN_LETTER_SHARE else None


def _docstrings(module) -> list[str]:
    docs = [module.__doc__]
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue  # private, or imported from elsewhere (counted once, with its own module)
        if inspect.isfunction(obj) or inspect.isclass(obj):
            docs.append(obj.__doc__)
        if inspect.isclass(obj):
            docs += [m.__doc__ for k, m in sorted(vars(obj).items())
                     if not k.startswith("_") and (inspect.isfunction(m) or isinstance(m, (property, classmethod,
                                                                                            staticmethod)))]
    return [d for d in docs if isinstance(d, str)]


def stdlib_sentences(modules=MODULES) -> list[str]:
    """The sorted, deduplicated first sentences of the docstrings of `modules` (see the module docstring)."""
    found = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a deprecation warning on import is not our business here
        for name in modules:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            found.update(s for d in _docstrings(module) if (s := first_sentence(d)) is not None)
    return sorted(found)


def sentence_split(*, calibration: int, evaluation: int) -> tuple[list[str], list[str]]:
    """Disjoint (calibration, evaluation) sentence lists of the requested sizes, in a fixed pseudo-random order.

    Raises:
        ValueError: the standard library of this Python yields fewer sentences than asked for.
    """
    sentences = sorted(stdlib_sentences(), key=lambda s: (zlib.crc32(s.encode()), s))
    if calibration + evaluation > len(sentences):
        raise ValueError(f"asked for {calibration} + {evaluation} sentences, this Python's standard library gives "
                         f"{len(sentences)}")
    return sentences[:calibration], sentences[calibration:calibration + evaluation]


if __name__ == "__main__":
    every = stdlib_sentences()
    print(f"{len(every)} sentences from {len(MODULES)} modules (Python {sys.version.split()[0]})")
    for s in sorted(every, key=lambda s: zlib.crc32(s.encode()))[:20]:
        print(" ", s)
