"""
The report card of a run: <base_dir>/report/<run_name>/report.md with one section per stage (base, mid, sft, rl, eval),
each with the system, the config, the wall time, the auto-batch-size record, tokens/s and MFU, the losses, the chat
eval table and PNG plots (matplotlib, Agg) of the losses and of tokens/s over steps. After nanochat v0's report card
(karpathy/nanochat `nanochat/report.py`); our format and code.

Each stage's section is kept as <stage>.md (and its numbers as <stage>.json) in the report directory; report.md is
rebuilt from them in stage order after every write, so writing a stage again replaces its section. Every file is
written atomically. matplotlib keeps its caches in <base_dir>/matplotlib unless MPLCONFIGDIR is set.

    python -m nanotrain.report <run_name>      # (re)writes every stage's section it finds, prints the report path
"""

import contextlib
import json
import os
import platform
import statistics
import sys
import time

import torch

from nanotrain.common import atomic_write_json, atomic_write_text, die, get_base_dir, git_commit, is_master
from nanotrain.errors import UserError, os_error_line
from nanotrain.report.plots import read_metrics, write_plots

STAGES = ("base", "mid", "sft", "rl", "eval")
TITLES = {"base": "Base training", "mid": "Midtraining", "sft": "Chat SFT", "rl": "RL", "eval": "Chat eval"}
SUBSECTIONS = ("System", "Config", "Auto batch size", "Speed", "Loss", "Chat eval", "Plots")


def report_dir(run_name):
    """<base_dir>/report/<run_name>/ (created). Raises UserError for an empty name or one with a path separator."""
    if not run_name or os.sep in run_name or run_name in (".", ".."):
        raise UserError(f"report: run name {run_name!r}: expected a plain, non-empty name")
    d = os.path.join(get_base_dir(), "report", run_name)
    os.makedirs(d, exist_ok=True)
    return d


# ----------------------------------------------------------------------------- reading a run directory

def _read_json(path):
    """The JSON object in `path`, or None if the file is absent. Raises UserError naming the file if it is corrupt."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: not valid JSON ({e})") from None


def system_info():
    """{"device", "cores", "torch", "python", "git_commit"} of this machine (the GPU name when CUDA is available)."""
    if torch.cuda.is_available():
        device = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    else:
        names = []
        with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        device = names[0] if names else platform.processor() or "CPU"
    return {"device": device, "cores": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "git_commit": git_commit()}


def summarize(run_dir, stage, extra=None):
    """
    The numbers of one stage's run directory as a JSON-able dict: config, auto_batch_size (record or None),
    chat_eval (or None), steps, train_time_s (sum of the steps' dt), median tokens/s and MFU (the first step, which
    holds compilation and warm-up, is left out when there are others), first/last train loss, the validation metric
    name ("val_bpb" or "val_loss") with its first/last values, and `extra` (e.g. {"wall_time_s": ...}).
    Stage "eval" reads only chat_eval.json (its config is chat_eval's settings).
    """
    if stage == "eval":
        chat = _read_json(os.path.join(run_dir, "chat_eval.json"))
        if chat is None:
            raise UserError(f"report: {run_dir}/chat_eval.json not found (run scripts/chat_eval.py first)")
        return {"config": chat.get("config", {}), "auto_batch_size": None, "chat_eval": chat, "steps": 0,
                "train_time_s": 0.0, "tokens_per_sec": None, "mfu": None, "first_loss": None, "last_loss": None,
                "val_key": None, "val_first": None, "val_last": None, "extra": dict(extra or {})}
    train, val = read_metrics(run_dir)
    steady = train[1:] if len(train) > 1 else train
    val_key = next((k for k in ("val_bpb", "val_loss", "eval_pass1") if any(k in r for r in val)), None)
    vals = [r for r in val if val_key in r]
    med = (lambda key: statistics.median(r[key] for r in steady if r.get(key) is not None)
           if any(r.get(key) is not None for r in steady) else None)  # mfu is None on a card of unknown peak
    return {
        "config": _read_json(os.path.join(run_dir, "config.json")) or {},
        "auto_batch_size": _read_json(os.path.join(run_dir, "auto_batch_size.json")),
        "chat_eval": _read_json(os.path.join(run_dir, "chat_eval.json")),
        "core": _read_json(os.path.join(run_dir, "core.json")) if stage == "base" else None,
        "steps": train[-1]["step"] if train else 0,
        "train_time_s": sum(r["dt"] for r in train),
        "tokens_per_sec": med("tok_per_sec"), "mfu": med("mfu"),
        "first_loss": train[0]["loss"] if train else None, "last_loss": train[-1]["loss"] if train else None,
        "val_key": val_key,
        "val_first": [vals[0]["step"], vals[0][val_key]] if vals else None,
        "val_last": [vals[-1]["step"], vals[-1][val_key]] if vals else None,
        "extra": dict(extra or {}),
    }


# ----------------------------------------------------------------------------- markdown

def _fmt(v):
    """A value for a markdown table cell: floats to 4 significant digits, None and "" spelled out, | escaped."""
    if isinstance(v, float):
        return f"{v:.4g}"
    if v is None or v == "":
        return repr(v)
    return str(v).replace("|", "\\|")


def config_table(config, columns=3):
    """A markdown table of the settings, `columns` setting/value pairs per row, keys sorted."""
    items = sorted(config.items())
    if not items:
        return "(no config.json)"
    head = "| " + " | ".join(["setting | value"] * columns) + " |"
    sep = "|" + "---|" * (2 * columns)
    rows = []
    for i in range(0, len(items), columns):
        cells = [f"`{k}` | {_fmt(v)}" for k, v in items[i:i + columns]]
        cells += [" | "] * (columns - len(cells))
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join([head, sep, *rows])


def chat_eval_table(chat_eval):
    """The markdown table of a chat_eval.json (scripts/chat_eval.py): task, correct, total, accuracy, chance level,
    95% interval, then ChatCORE when all five benchmarks ran."""
    if not chat_eval:
        return "(no chat_eval.json)"
    lines = [f"{chat_eval.get('source', '?')} checkpoint step {chat_eval.get('step', '?')}", "",
             "| task | correct | total | accuracy | chance | 95% interval |", "|---|---:|---:|---:|---:|---:|"]
    for name, r in chat_eval.get("results", {}).items():
        lo, hi = r.get("ci95", (0.0, 1.0))
        lines.append(f"| {name} | {r['correct']:g} | {r['total']} | {100 * r['accuracy']:.2f}% | "
                     f"{100 * r.get('chance', 0.0):.0f}% | [{100 * lo:.1f}, {100 * hi:.1f}] |")
    if chat_eval.get("chatcore") is not None:
        lines += ["", f"ChatCORE **{chat_eval['chatcore']:.4f}** (mean centred accuracy of ARC-Easy, ARC-Challenge, "
                      f"MMLU, GSM8K and HumanEval)"]
    return "\n".join(lines)


def core_table(core):
    """The markdown of a core.json (nanotrain.evaluation.core_eval.write_results): CORE, then accuracy and centred accuracy per
    task."""
    cut = core.get("max_per_task", -1)
    lines = [f"CORE **{core['core']:.4f}** at step {core.get('step', '?')}"
             + (f" (at most {cut} rows per task)" if cut and cut > 0 else "") + " (scripts/base_eval.py)", "",
             "| task | type | shots | rows | accuracy | centred |", "|---|---|---:|---:|---:|---:|"]
    for label in core.get("order", core.get("tasks", {})):
        r = core["tasks"][label]
        lines.append(f"| {label} | {r['task_type']} | {r['num_fewshot']} | {r['rows']} | {r['accuracy']:.4f} | "
                     f"{r['centered']:.4f} |")
    return "\n".join(lines)


def chat_eval_comparison(run_name, run_dir):
    """
    A markdown table comparing the chat eval accuracy of every stage of `run_name` that has a chat_eval.json (e.g. the
    base model, the baseline, against the SFT model), plus `run_dir`'s; "" when fewer than two stages have one. Two
    consecutive stages that both wrote chat_eval_samples.jsonl (--log_samples=True) on shared problems also get their
    paired comparison (samples_comparison).
    """
    dirs = dict(find_stage_dirs(run_name))
    dirs.pop("eval", None)
    if os.path.abspath(run_dir) not in [os.path.abspath(d) for d in dirs.values()]:
        dirs[os.path.basename(os.path.dirname(os.path.abspath(run_dir))) or "run"] = run_dir
    evals, sample_files = {}, {}
    for stage, d in dirs.items():
        e = _read_json(os.path.join(d, "chat_eval.json"))
        if e:
            evals[stage] = e
            sample_files[stage] = os.path.join(d, "chat_eval_samples.jsonl")
    if len(evals) < 2:
        return ""
    tasks = list(dict.fromkeys(t for e in evals.values() for t in e.get("results", {})))
    lines = ["| task | " + " | ".join(evals) + " |", "|---|" + "---:|" * len(evals)]
    for t in tasks:
        cells = [f"{100 * e['results'][t]['accuracy']:.2f}%" if t in e.get("results", {}) else ""
                 for e in evals.values()]
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    if any(e.get("chatcore") is not None for e in evals.values()):
        lines.append("| ChatCORE | " + " | ".join(f"{e['chatcore']:.4f}" if e.get("chatcore") is not None else ""
                                                  for e in evals.values()) + " |")
    paired = samples_comparison([(k, sample_files[k]) for k in evals])
    return ("Accuracy by stage (greedy decoding; the built-in tasks' validation split, the benchmarks' test "
            "split):\n\n" + "\n".join(lines) + (f"\n\n{paired}" if paired else ""))


def samples_comparison(stage_files):
    """
    Markdown: for each consecutive pair of [(stage, sample file path)] whose files both exist and share problems,
    nanotrain.evaluation.compare_samples' table (flips, the difference with its 95% paired interval, the exact McNemar p);
    "" when no pair has. Raises UserError for a sample file that is not one.
    """
    from nanotrain.evaluation.compare_samples import compare, format_comparison
    from nanotrain.evaluation.samples import read_samples
    present = [(stage, path) for stage, path in stage_files if os.path.exists(path)]
    parts = []
    for (sa, pa), (sb, pb) in zip(present, present[1:]):
        result = compare(read_samples(pa), read_samples(pb))
        if any(r["problems"] for r in result.values()):
            parts.append(f"Paired comparison {sa} -> {sb} on the same problems (Agresti & Min 2005 interval, exact "
                         f"McNemar p):\n\n```\n{format_comparison(result, sa, sb)}\n```")
    return "\n\n".join(parts)


def auto_batch_text(record):
    """One paragraph summarising an auto_batch_size.json record (found size, probes, cache hit, budget)."""
    if not record:
        return "not used (device_batch_size set by hand or the fixed default)"
    probes = ", ".join(f"{p['batch_size']}: {p['result']}" for p in record.get("probes", []))
    budget = record.get("budget_bytes")
    text = (f"device_batch_size **{record.get('device_batch_size')}** (grad_accum_steps "
            f"{record.get('grad_accum_steps')}) | cache {'hit' if record.get('cache_hit') else 'miss'} | budget "
            f"{budget / 2**30:.2f} GiB x margin {record.get('margin')} | measurement: {record.get('measurement')} | "
            f"{len(record.get('probes', []))} probes ({probes})" if budget else f"record: {record}")
    if record.get("step_downs"):
        text += f" | OOM step-downs [step, from, to]: {record['step_downs']}"
    return text


def render_section(stage, summary, system, plots, comparison=""):
    """The markdown of one stage's section (## heading and the SUBSECTIONS as ### headings); `comparison` (markdown)
    is added under Chat eval."""
    s = summary
    wall = s["extra"].get("wall_time_s")
    if stage == "eval":
        speed = [f"- wall time: {wall / 60:.2f} min" if wall is not None else "(an evaluation: no training steps)"]
    else:
        speed = [f"- steps: {s['steps']}, training time (sum of step times): {s['train_time_s'] / 60:.2f} min"
                 + (f", wall time of the stage: {wall / 60:.2f} min" if wall is not None else "")]
    if s["tokens_per_sec"] is not None:
        mfu = f", MFU {100 * s['mfu']:.1f}%" if s["mfu"] is not None else ""
        speed.append(f"- median tokens/s {s['tokens_per_sec']:,.0f}{mfu} (first step left out)")
        if s["mfu"] is not None and s["mfu"] > 1:
            speed.append("- MFU above 100%: the matmul peak the run measured at its start (the MFU denominator on "
                         "CPU) was measured while other work was using the cores; see scripts/bench.py for a "
                         "controlled figure")
    loss = []
    if s["first_loss"] is not None:
        loss.append(f"- train loss: first {s['first_loss']:.4f}, last {s['last_loss']:.4f}")
    if s["val_key"]:
        (a_step, a), (b_step, b) = s["val_first"], s["val_last"]
        loss.append(f"- {s['val_key'].replace('_', ' ')}: {a:.4f} at step {a_step}, {b:.4f} at step {b_step}")
    for k, v in s["extra"].items():
        if k != "wall_time_s":
            loss.append(f"- {k}: {_fmt(v)}")
    if s.get("core"):
        loss.append("\n" + core_table(s["core"]))
    parts = [
        f"## {stage}: {TITLES[stage]}",
        "### System",
        f"{system['device']} ({system['cores']} cores) | torch {system['torch']} | python {system['python']} | "
        f"git {system['git_commit']}",
        "### Config", config_table(s["config"]),
        "### Auto batch size", auto_batch_text(s["auto_batch_size"]) if stage != "eval" else "(n/a)",
        "### Speed", "\n".join(speed),
        "### Loss", "\n".join(loss) or "(no metrics)",
        "### Chat eval", chat_eval_table(s["chat_eval"]) + (f"\n\n{comparison}" if comparison else ""),
        "### Plots", "\n".join(f"![{p}]({p})" for p in plots) or "(no metrics to plot)",
    ]
    return "\n\n".join(parts) + "\n"


def _assemble(run_name, out_dir):
    """Rebuilds report.md from the stage sections present, with a summary table first. Returns its path."""
    rows, sections, total = [], [], 0.0
    for stage in STAGES:
        md, js = os.path.join(out_dir, f"{stage}.md"), os.path.join(out_dir, f"{stage}.json")
        if not os.path.exists(md):
            continue
        with open(md) as f:
            sections.append(f.read())
        s = _read_json(js) or {}
        wall = (s.get("extra") or {}).get("wall_time_s", s.get("train_time_s"))
        total += wall or 0.0
        val = f"{s['val_key']} {s['val_last'][1]:.4f}" if s.get("val_last") else ""
        chat = s.get("chat_eval") or {}
        acc = ", ".join(f"{k} {100 * r['accuracy']:.1f}%" for k, r in chat.get("results", {}).items())
        tps = f"{s['tokens_per_sec']:,.0f}" if s.get("tokens_per_sec") else ""
        mfu = f"{100 * s['mfu']:.1f}%" if s.get("mfu") is not None else ""
        rows.append(f"| {stage} | {(wall or 0) / 60:.2f} | {tps} | {mfu} | {val} | {acc} |")
    head = [f"# nanotrain report card: {run_name}", "",
            f"Updated {time.strftime('%Y-%m-%d %H:%M:%S')}. Total time of the stages below: {total / 60:.2f} min "
            f"(the wall time each stage's script recorded; the tokenizer, data downloads and the base model's CORE "
            f"evaluation are not counted).", "",
            "| stage | minutes | tokens/s | MFU | validation | chat eval |", "|---|---:|---:|---:|---|---|", *rows, ""]
    path = os.path.join(out_dir, "report.md")
    atomic_write_text(path, "\n".join(head) + "\n" + "\n".join(sections))
    return path


def write_section(run_name, stage, run_dir, extra=None):
    """
    Writes (or replaces) `stage`'s section of <base_dir>/report/<run_name>/report.md from the stage's run directory
    (config.json, metrics.jsonl, auto_batch_size.json and chat_eval.json when present), with the plots
    <stage>_loss.png and <stage>_tokens_per_sec.png. extra: optional dict shown in the section; "wall_time_s"
    (seconds) is the stage's wall time; when None, the extra recorded by the last write of this stage from the same
    run_dir is kept (so regenerating the report keeps the scripts' wall times). Only rank 0 writes: returns the report path, or None on other ranks.
    Raises UserError for an unknown stage, a missing run_dir or a corrupt JSON file.
    """
    if stage not in STAGES:
        raise UserError(f"report: stage {stage!r}: expected one of {', '.join(STAGES)}")
    if not os.path.isdir(run_dir):
        raise UserError(f"report: run directory {run_dir} does not exist")
    if not is_master():
        return None
    out_dir = report_dir(run_name)
    if extra is None:  # a regeneration (python -m nanotrain.report) keeps what the script recorded, e.g. wall time
        old = _read_json(os.path.join(out_dir, f"{stage}.json")) or {}
        extra = old.get("extra") if old.get("run_dir") == os.path.abspath(run_dir) else None
    summary = dict(summarize(run_dir, stage, extra), run_dir=os.path.abspath(run_dir))
    plots = write_plots(run_dir, out_dir, stage) if stage != "eval" else []
    atomic_write_json(os.path.join(out_dir, f"{stage}.json"), summary)
    comparison = chat_eval_comparison(run_name, run_dir) if stage == "eval" else ""
    atomic_write_text(os.path.join(out_dir, f"{stage}.md"),
                      render_section(stage, summary, system_info(), plots, comparison))
    return _assemble(run_name, out_dir)


def write_section_or_warn(run_name, stage, run_dir, extra=None):
    """
    write_section for a script whose own work is done and saved (a finished training stage, chat_eval's results): a
    report card that cannot be written (an OSError such as a full or read-only disk, or a UserError) is one
    `warning: ...` line on stderr naming the problem and how to write the card later, and None is returned, so the
    script still succeeds; write_section leaves no temporary file. Otherwise prints `Report card: <path>` (rank 0)
    and returns the report path (None on ranks other than 0). The training scripts call it last, after
    nanotrain.run.finish_run, with {"wall_time_s": the stage's wall time}.
    """
    try:
        report = write_section(run_name, stage, run_dir, extra)
        if report:
            print(f"Report card: {report}", flush=True)
        return report
    except (OSError, UserError) as exc:
        why = os_error_line(exc) or (str(exc) if isinstance(exc, UserError) else f"{type(exc).__name__}: {exc}")
        print(f"warning: the report card was not written: {why}; the {stage} stage itself is complete and saved "
              f"(write the card later with: python -m nanotrain.report {run_name})", file=sys.stderr, flush=True)
        return None


def find_stage_dirs(run_name):
    """{stage: run_dir} of the stages of `run_name` present under the base dir; "eval" is the last stage's run
    directory (in the order base, mid, sft, rl) that holds a chat_eval.json."""
    base = get_base_dir()
    found = {}
    for stage in ("base", "mid", "sft", "rl"):
        d = os.path.join(base, stage, run_name)
        if os.path.isfile(os.path.join(d, "config.json")) or os.path.isfile(os.path.join(d, "metrics.jsonl")):
            found[stage] = d
    evals = [d for d in found.values() if os.path.isfile(os.path.join(d, "chat_eval.json"))]
    if evals:
        found["eval"] = evals[-1]
    return found


def main(argv=None):
    """`python -m nanotrain.report <run_name>`: rewrites every stage's section found; prints the report path."""

    argv = sys.argv[1:] if argv is None else argv
    try:
        if len(argv) != 1 or argv[0].startswith("-"):
            raise UserError("usage: python -m nanotrain.report <run_name>")
        found = find_stage_dirs(argv[0])
        if not found:
            raise UserError(f"no run named {argv[0]!r} under {get_base_dir()}/{{base,mid,sft,rl}}/")
        path = None
        for stage, run_dir in found.items():
            path = write_section(argv[0], stage, run_dir)
        print(path)
    except UserError as e:
        die(str(e))
    except OSError as e:  # the user's environment (full or read-only disk, ...): one line; anything else a traceback
        line = os_error_line(e)
        if line is None:
            raise
        die(line, 1)


if __name__ == "__main__":
    main()
