"""
EleutherAI's lm-evaluation-harness (https://github.com/EleutherAI/lm-evaluation-harness) on a base checkpoint: the
checkpoint is exported as a transformers directory (nanotrain.export.hf) and the harness's own "hf" model loads it
(trust_remote_code, fp32, <|bos|> before every request as the project's documents start with it). Any harness task
or group runs, from its registry or from a directory of local task YAMLs (include_path). The harness is optional:
pip install "lm_eval[hf]" (LM_EVAL_HINT); it installs without touching the pins of requirements.txt.

Equivalent command line on an exported directory:
    lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True,add_bos_token=True,dtype=float32 \\
        --tasks hellaswag,arc_easy --device cpu --batch_size 8
"""

import math
import os

from nanotrain.checkpoint import load_model
from nanotrain.common import atomic_write_json, print0
from nanotrain.downloads import check_reachable  # the same fail-fast TCP check as every hub loader
from nanotrain.errors import UserError
from nanotrain.export.hf import export_hf, require_transformers

LM_EVAL_HINT = 'pip install "lm_eval[hf]==0.4.13" (installs without touching the pins of requirements.txt)'


def import_lm_eval():
    """Returns (lm_eval, TaskManager). Raises UserError (one line: what to install) when the harness is missing."""
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError as exc:
        raise UserError(f"--lm_eval_tasks needs lm-evaluation-harness ({exc.name or 'lm_eval'} cannot be imported): "
                        f"{LM_EVAL_HINT}") from None
    return lm_eval, TaskManager


def offline_unless_reachable():
    """
    Unless the hub is already set offline (HF_HUB_OFFLINE), a 5 s TCP check of its endpoint; when it fails, the hub
    and datasets are switched to offline mode for this process (their environment variables and the constants they
    read at import), so that a task whose data are not local fails at once instead of after the libraries' retries,
    and local tasks still run. Returns True when offline.
    """
    import huggingface_hub.constants as hub
    if hub.HF_HUB_OFFLINE:
        return True
    try:
        check_reachable(hub.ENDPOINT)
        return False
    except OSError:
        import datasets.config
        os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
        hub.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
        return True


def run_lm_eval(model_dir, tasks, include_path="", limit=-1, device="cpu", batch_size=8, log_samples=False):
    """
    Runs the harness on the transformers directory `model_dir` (from nanotrain.export.hf.export_hf). tasks: task or
    group names, comma-separated (str). include_path: a directory of task YAMLs added to the registry ("" none).
    limit: rows per task, -1 all. Returns {task: {"metric,filter": value}} with the harness's float results
    (accuracies in [0, 1], their stderr); with log_samples=True, (that dict, the harness's per-row samples
    {task: [{"doc", "arguments", "resps" (per request [(log-likelihood, is_greedy)]), ...}]}). Raises UserError (one line) when the harness is missing, no task is given,
    include_path is not a directory, a task is unknown, or a task's data cannot be loaded (offline, detected within
    seconds by offline_unless_reachable: only data sets in the datasets cache and local files can be read).
    """
    lm_eval, TaskManager = import_lm_eval()
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    if not names:
        raise UserError(f"--lm_eval_tasks={tasks!r}: expected comma-separated harness task names, e.g. hellaswag")
    if include_path and not os.path.isdir(include_path):
        raise UserError(f"--lm_eval_include={include_path}: not a directory of task YAML files")
    offline_unless_reachable()
    model_args = {"pretrained": model_dir, "trust_remote_code": True, "add_bos_token": True, "dtype": "float32"}
    try:
        out = lm_eval.simple_evaluate(model="hf", model_args=model_args, tasks=names,
                                      task_manager=TaskManager(include_path=include_path or None), device=device,
                                      batch_size=batch_size, limit=limit if limit > 0 else None,
                                      log_samples=log_samples)
    except KeyError as exc:  # the harness's "Spec 'x' is not a registered task/group/tag name or valid YAML path"
        raise UserError(f"--lm_eval_tasks: {str(exc).strip(chr(34))}") from None
    except (ConnectionError, OSError) as exc:
        raise UserError(f"--lm_eval_tasks={tasks}: a task's data could not be loaded ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:200]}); offline, only data sets already in the datasets cache "
                        f"or local task files (--lm_eval_include=DIR) can run") from None
    results = {task: {k: v for k, v in metrics.items() if isinstance(v, float) and not math.isnan(v)}
               for task, metrics in out["results"].items()}
    return (results, out["samples"]) if log_samples else results


def evaluate_checkpoint(run_name, step, device, tasks, include_path="", limit=-1):
    """
    scripts/base_eval.py --lm_eval_tasks: loads the base checkpoint (newest run / step when "" / -1), exports it to
    <run_dir>/export/hf, runs the harness (run_lm_eval), prints one line per task and metric and writes
    <run_dir>/lm_eval.json ({"results", "step", "checkpoint", "tasks"}). One process only. Raises UserError (one
    line) as run_lm_eval does, before the checkpoint is read when the harness or transformers is missing, and under
    torchrun (the harness batches by itself).
    """
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError("--lm_eval_tasks runs in one process: start base_eval.py with python, not torchrun")
    require_transformers()
    import_lm_eval()
    model, tokenizer, path, meta = load_model("base", run_name, step, "cpu")
    print0(f"checkpoint: {path}")
    run_dir = os.path.dirname(os.path.dirname(path))
    model_dir = export_hf(model, tokenizer, os.path.join(run_dir, "export", "hf"))
    results = run_lm_eval(model_dir, tasks, include_path, limit, device.type if hasattr(device, "type") else device)
    for task, metrics in results.items():
        print0(f"{task}: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items())))
    out = os.path.join(run_dir, "lm_eval.json")
    atomic_write_json(out, {"results": results, "step": meta.get("step"), "checkpoint": path, "tasks": tasks})
    print0(f"saved {out}")
    return results
