"""
Which files one base_train step is read from, counted by following the calls: runs scripts/base_train.py in this
process on a tiny model (depth 2, 3 steps, a save at the end) under sys.setprofile, and lists the project's files
(nanotrain/**, scripts/base_train.py) whose Python functions run
  math  inside training.forward_backward and training.optimizer_step (the model, its kernels, the optimizers),
  loop  in the training loop once it started (the first next_batch) outside the evaluations, the samples and the
        save: the math plus the loader, rank agreement, stop requests, timing, the schedules and the log,
  save  the loop plus everything inside save_checkpoint.
Module-level code run at import time is not counted (a reader follows calls, not imports).

    python dev/step_files.py            # prints the three lists and their counts
"""

import os
import runpy
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MATH_ROOTS = {"forward_backward", "optimizer_step"}
SAVE_ROOTS = {"save_checkpoint"}
SKIP_ROOTS = {"evaluate_bpb", "evaluate_gold_bpb", "evaluate_core", "generate", "write_results", "report_section",
              "write_section_or_warn", "replica_check"}


def ours(filename):
    f = os.path.abspath(filename)
    return f.startswith(os.path.join(REPO, "nanotrain") + os.sep) or f == os.path.join(REPO, "scripts", "base_train.py")


def main():
    seen = {"math": set(), "loop": set(), "save": set()}
    started = [False]

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if code.co_name == "next_batch":
            started[0] = True
        if not started[0] or not ours(code.co_filename):
            return
        names, f = [], frame
        while f is not None:
            names.append(f.f_code.co_name)
            f = f.f_back
        rel = os.path.relpath(code.co_filename, REPO)
        if any(n in SKIP_ROOTS for n in names):
            return
        if any(n in MATH_ROOTS for n in names):
            seen["math"].add(rel)
        elif any(n in SAVE_ROOTS for n in names):
            seen["save"].add(rel)
        else:
            seen["loop"].add(rel)

    base = tempfile.mkdtemp(prefix="step_files_")
    os.environ["NANOTRAIN_BASE_DIR"] = base
    tok = ["scripts/tok_train.py", "--vocab_size=512", "--max_chars=200000"]
    train = ["scripts/base_train.py", "--depth=2", "--max_seq_len=64", "--device_batch_size=2",
             "--total_batch_size=256", "--num_iterations=3", "--eval_every=-1", "--eval_tokens=512",
             "--sample_every=-1", "--save_every=-1", "--compile=False", "--run_name=step_files", "--device_type=cpu"]
    os.chdir(REPO)
    for argv in (tok, train):
        sys.argv = argv
        if argv is train:
            sys.setprofile(profile)
        try:
            runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as exc:
            if exc.code not in (0, None):
                raise
        finally:
            sys.setprofile(None)
    math = sorted(seen["math"])
    loop = sorted(seen["math"] | seen["loop"])
    save = sorted(seen["math"] | seen["loop"] | seen["save"])
    for name, files in (("math", math), ("loop", loop), ("save", save)):
        print(f"{name}: {len(files)} files: {', '.join(files)}")


if __name__ == "__main__":
    main()
