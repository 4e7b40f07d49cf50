"""
Code lines of the package, the way the house round counted them: every line of nanotrain/**/*.py that holds a token
of code, so blank lines, comment-only lines and docstrings (module, class, function) are not counted; a line with
code and a trailing comment counts once.

    python dev/count_code_lines.py            # the total, then per file (largest first)
    python dev/count_code_lines.py --files    # per file only
"""

import ast
import io
import os
import sys
import tokenize

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def code_lines(path):
    """The number of lines of `path` (a Python file) holding a code token outside docstrings."""
    src = open(path, encoding="utf-8").read()
    doc = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                doc.update(range(first.lineno, first.end_lineno + 1))
    lines = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type in skip:
            continue
        for line in range(tok.start[0], tok.end[0] + 1):
            if line not in doc:
                lines.add(line)
    return len(lines)


def main():
    counts = {}
    for root, _, files in os.walk(os.path.join(REPO, "nanotrain")):
        for f in files:
            if f.endswith(".py"):
                p = os.path.join(root, f)
                counts[os.path.relpath(p, REPO)] = code_lines(p)
    if "--files" not in sys.argv:
        print(f"total: {sum(counts.values())} code lines in {len(counts)} files")
    for p, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        print(f"{n:6d}  {p}")


if __name__ == "__main__":
    main()
