"""
Two evaluations of the same problems compared from their sample files (nanotrain.evaluation.samples: chat_eval_samples.jsonl,
core_samples.jsonl): per task, the problems that flipped each way, the accuracy difference B - A with a 95% interval
for paired proportions, and the exact McNemar test's p-value, so that "B beat A on arith" comes with whether it
could be noise.

    python -m nanotrain.evaluation.compare_samples A.jsonl B.jsonl

Problems are paired by (task, doc_id); those in one file only are counted and left out. Methods:
- the interval: Agresti & Min (2005), "Simple improved confidence intervals for comparing matched proportions"
  (Statistics in Medicine 24:729-740): the Wald interval of the paired difference after adding 1/2 to each of the
  four cells of the 2x2 table;
- the p-value: McNemar's test in its exact form, the two-sided binomial test of the discordant pairs (b problems
  right in A only, c right in B only) against Binomial(b + c, 1/2): min(1, 2 * P(X <= min(b, c))); 1 when b + c = 0.
"""

import math
import sys

from nanotrain.errors import UserError
from nanotrain.evaluation.samples import read_samples

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile


def mcnemar_exact(b, c):
    """Two-sided exact McNemar p-value of b and c discordant pairs (ints >= 0): min(1, 2 * P(X <= min(b, c))) for
    X ~ Binomial(b + c, 1/2); 1.0 when b + c = 0."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_interval(both, a_only, b_only, neither, z=Z95):
    """The 95% interval (low, high) of accuracy(B) - accuracy(A) for paired 0/1 outcomes counted in a 2x2 table
    (both right, right in A only, right in B only, both wrong), by Agresti & Min (2005): 1/2 added to each cell, then
    the Wald interval d +- z * sqrt(((p12 + p21) - (p21 - p12)^2) / n), clipped to [-1, 1]."""
    n = both + a_only + b_only + neither + 2.0
    p12, p21 = (a_only + 0.5) / n, (b_only + 0.5) / n
    d = p21 - p12
    half = z * math.sqrt(max(0.0, (p12 + p21) - d * d) / n)
    return max(-1.0, d - half), min(1.0, d + half)


def compare(rows_a, rows_b):
    """{task: {"problems", "only_in_one", "acc_a", "acc_b", "diff" (B - A), "ci95", "a_only" (right in A only: flips
    to wrong), "b_only" (flips to right), "p_value", "flipped_to_right", "flipped_to_wrong" (doc_ids)}} of two lists
    of sample rows, paired by (task, doc_id); a row is right when its "correct" is true."""
    a = {(r["task"], r["doc_id"]): bool(r["correct"]) for r in rows_a}
    b = {(r["task"], r["doc_id"]): bool(r["correct"]) for r in rows_b}
    out = {}
    for task in sorted({k[0] for k in a} | {k[0] for k in b}):
        keys = sorted(k for k in a if k[0] == task and k in b)
        unpaired = sum(1 for k in a if k[0] == task and k not in b) + sum(1 for k in b if k[0] == task and k not in a)
        table = {(x, y): [k[1] for k in keys if a[k] == x and b[k] == y] for x in (True, False) for y in (True, False)}
        n = len(keys)
        ca, cb = len(table[True, True]) + len(table[True, False]), len(table[True, True]) + len(table[False, True])
        a_only, b_only = len(table[True, False]), len(table[False, True])
        out[task] = {"problems": n, "only_in_one": unpaired, "acc_a": ca / n if n else 0.0,
                     "acc_b": cb / n if n else 0.0, "diff": (cb - ca) / n if n else 0.0,
                     "ci95": list(paired_interval(len(table[True, True]), a_only, b_only, len(table[False, False]))),
                     "a_only": a_only, "b_only": b_only, "p_value": mcnemar_exact(a_only, b_only),
                     "flipped_to_right": table[False, True], "flipped_to_wrong": table[True, False]}
    return out


def format_comparison(result, name_a="A", name_b="B"):
    """The comparison (compare's dict) as a text table, one line per task with problems in both files."""
    lines = [f"{'task':<24} {'problems':>8} {name_a[:9]:>9} {name_b[:9]:>9} {'diff':>8}  95% interval    "
             f"{'->right':>7} {'->wrong':>7} {'McNemar p':>10}"]
    for task, r in result.items():
        if not r["problems"]:
            continue
        lo, hi = r["ci95"]
        lines.append(f"{task:<24} {r['problems']:>8} {100 * r['acc_a']:>8.2f}% {100 * r['acc_b']:>8.2f}% "
                     f"{100 * r['diff']:>+7.2f}%  [{100 * lo:+.1f}, {100 * hi:+.1f}]  {r['b_only']:>7} "
                     f"{r['a_only']:>7} {r['p_value']:>10.4g}")
    return "\n".join(lines)


def main(argv=None):
    """`python -m nanotrain.evaluation.compare_samples A B`: prints the table of compare(A, B) and the problems that flipped.
    Raises UserError for a wrong argument count or a file that is not a sample file."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        raise UserError("usage: python -m nanotrain.evaluation.compare_samples A.jsonl B.jsonl (two sample files written with "
                        "--log_samples=True)")
    result = compare(read_samples(argv[0]), read_samples(argv[1]))
    if not any(r["problems"] for r in result.values()):
        raise UserError(f"{argv[0]} and {argv[1]} share no problem (task and doc_id): nothing to compare")
    print(format_comparison(result))
    print("interval: Agresti & Min (2005) for paired proportions; p: exact McNemar (two-sided binomial on the "
          "discordant pairs)")
    for task, r in result.items():
        if r["flipped_to_right"] or r["flipped_to_wrong"]:
            print(f"{task}: to right {r['flipped_to_right'][:20]}, to wrong {r['flipped_to_wrong'][:20]}")
        if r["only_in_one"]:
            print(f"{task}: {r['only_in_one']} problems in one file only, left out")


if __name__ == "__main__":
    from nanotrain.common import run_script
    run_script(main)
