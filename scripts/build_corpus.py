"""Build the small English corpus the repo ships for CPU debug runs and tests.

The text is the prose of the CPython standard library itself (PSF License), so any machine
with CPython 3.11 can rebuild it with no network:

  * docstrings of modules, classes and functions (read with `ast`, never imported: importing
    hundreds of modules has side effects and is slow);
  * blocks of consecutive `#` comment lines (much of the stdlib's explanation lives there);
  * `pydoc_data.topics`, the Language Reference sections that `help()` shows.

Docstrings alone come to ~1.1 MB even at 200+ characters each, so the comments and topics are
added and the floor is 100 characters: ~2.2 MB, inside the 2-4 MB target. Each docstring, comment
block or topic is one document. Output: JSON lines {"text": ...} in
hybridtitan/assets/corpus/{train,validation}.jsonl (the `datasets` json builder takes the split
from the file name).

    python scripts/build_corpus.py
"""

import argparse
import ast
import hashlib
import io
import json
import pathlib
import sys
import sysconfig
import tokenize
from pydoc_data.topics import topics

OUT = pathlib.Path(__file__).resolve().parent.parent / "hybridtitan" / "assets" / "corpus"
# Tests are full of fixtures rather than prose; the GUI packages and lib2to3 carry mostly code
# or data; ensurepip holds wheels; site-packages is not the standard library.
SKIP_DIRS = {"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip",
             "site-packages", "__pycache__"}
MIN_CHARS = 100          # shorter snippets are one-line summaries with little to learn from
MIN_PROSE = 0.8          # share of letters and spaces; drops code examples, tables, ASCII art
MAX_BYTES = 4_000_000    # upper end of the target size
VALID_PERCENT = 2


def normalise(text):
    """Collapse whitespace inside paragraphs, one paragraph per line.

    A line with no letter or digit (blank, or a rule like '****' under a heading) ends a paragraph.
    """
    paras, cur = [], []
    for line in text.splitlines() + [""]:
        if any(c.isalnum() for c in line):
            cur.append(line)
        elif cur:
            paras.append(" ".join(" ".join(cur).split()))
            cur = []
    return "\n".join(paras)


def prose_score(text):
    return sum(c.isalpha() or c.isspace() for c in text) / max(len(text), 1)


def stdlib_files():
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):           # sorted: filesystem order is not stable
        rel = path.relative_to(root)
        # config-*/ and _sysconfigdata*.py describe this particular build, not the library.
        if (SKIP_DIRS.isdisjoint(rel.parts[:-1]) and not rel.parts[0].startswith("config-")
                and not rel.name.startswith("_sysconfigdata")):
            yield path


def docstrings(source):
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)              # dedented with inspect.cleandoc
            if doc:
                yield doc


def comment_blocks(source):
    """Runs of full-line comments on consecutive lines, '#' markers removed."""
    block, last = [], None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT or tok.line.lstrip()[:1] != "#":
            continue                                   # code, or a comment trailing code
        if block and tok.start[0] != last + 1:
            yield "\n".join(block)
            block = []
        block.append(tok.string.lstrip("#").strip())
        last = tok.start[0]
    if block:
        yield "\n".join(block)


def main():
    texts, failed = [], []
    for path in stdlib_files():
        try:
            with tokenize.open(path) as f:             # honours PEP 263 coding cookies
                source = f.read()
            texts += list(docstrings(source)) + list(comment_blocks(source))
        except (SyntaxError, UnicodeDecodeError, tokenize.TokenError) as exc:
            failed.append(f"{path.name}: {exc.__class__.__name__}")
    texts += topics.values()

    docs = {normalise(t) for t in texts}               # a set: exact duplicates (licence headers) go
    docs = [d for d in docs if len(d) >= MIN_CHARS and prose_score(d) >= MIN_PROSE]
    # If over budget, keep the most prose-like documents.
    docs.sort(key=lambda d: (-prose_score(d), d))
    total, kept = 0, []
    for d in docs:
        total += len(d.encode())
        if total > MAX_BYTES:
            break
        kept.append(d)

    # Order and split by a content hash: stable across machines and runs (unlike hash(), which
    # is salted per process), and it interleaves sources so training sees a shuffled stream.
    digest = {d: hashlib.sha256(d.encode()).hexdigest() for d in kept}
    kept.sort(key=digest.get)
    OUT.mkdir(parents=True, exist_ok=True)
    splits = {"train": [], "validation": []}
    for d in kept:
        splits["validation" if int(digest[d], 16) % 100 < VALID_PERCENT else "train"].append(d)
    for name, rows in splits.items():
        with open(OUT / f"{name}.jsonl", "w", encoding="utf-8", newline="\n") as f:
            for d in rows:
                f.write(json.dumps({"text": d}, ensure_ascii=False) + "\n")
        size = (OUT / f"{name}.jsonl").stat().st_size
        print(f"{name}: {len(rows)} documents, {sum(map(len, rows))} characters, {size} bytes")
    print(f"python {sys.version.split()[0]}; {len(failed)} files skipped: {failed}")


if __name__ == "__main__":
    # no options: --help describes what running it overwrites
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
