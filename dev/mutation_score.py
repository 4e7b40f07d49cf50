"""
Mutation score (mutmut) of each module of [tool.mutation_score.modules] in pyproject.toml, against its own tests.

Usage: `python dev/mutation_score.py [nanotrain/sft_data.py ...]` (all modules by default).

For each module of [tool.mutation_score.modules] in pyproject.toml (module -> its own test files), copies the
repository's files (git ls-files: tracked and untracked-not-ignored) into mutants/<module name>/, rewrites the copy's
[tool.mutmut] so that only this module is mutated and only its test files are selected, runs `mutmut run` there and
reads the verdicts with `mutmut results --all true`. mutmut 3 itself runs every mutant against the selected tests
that cover the mutated function. Prints one table: module, killed/total (a timeout counts as killed: the mutant made
a test hang; on a loaded machine a slow test can time out too, so timeouts are also counted apart), score, and the
names of the mutants that were not killed (inspect one with
`cd mutants/<name> && mutmut show <mutant>`). Each run starts from a fresh copy, so nothing stale is reused.
Needs mutmut==3.8.1 (requirements.txt) and Python >= 3.11 (tomllib); runs from a clean clone. Slow, one mutant at a
time unless --max-children says otherwise: on 2 shared cores sft_data and dataloader take ~10 minutes each,
auto_batch_size hours (discover_device_batch_size alone has ~500 mutants, each running the discovery tests).
Exit status 1 if a module scores below --min or has mutants left unchecked.
As root (Linux), mutmut runs in PID, IPC and mount namespaces of its own (contained()): a mutant of the sandbox that
runs its hostile test programs as root kills this run, not the machine. One that SIGKILLs mutmut itself (the sweep's
kill(-1) helper run as root) ends the run with "returned non-zero exit status 247": go on with --again --skip GLOB
(its name: the first mutant left "not checked" in mutmut's order). To stop a run, SIGKILL its `unshare` (which
blocks SIGTERM while it waits): the namespace and everything in it go with it.
"""

import argparse
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys

import tomllib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KILLED = {"killed", "timeout", "caught by type check"}
MUTMUT = shutil.which("mutmut") or os.path.join(os.path.dirname(sys.executable), "mutmut")
# pid 1 of the namespaces that contained() runs mutmut in: private tmpfs on /tmp, /var/tmp and /dev/shm and its own
# /dev/mqueue, a pids cgroup of at most 4096 tasks where cgroup v1 has one (a root fork bomb), then the command;
# reaps every orphan, exits with the command's status. Its end (the namespace's) SIGKILLs whatever is left inside.
CONTAIN_INIT = """
import os, subprocess, sys
for d in ("/tmp", "/var/tmp", "/dev/shm"):
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=1777", "tmpfs", d], check=True)
if os.path.isdir("/dev/mqueue"):
    subprocess.run(["mount", "-t", "mqueue", "mqueue", "/dev/mqueue"], check=True)
cg = "/sys/fs/cgroup/pids/mutation-score-" + os.urandom(4).hex()
try:
    os.mkdir(cg)
    for name, value in (("pids.max", "4096"), ("cgroup.procs", "0")):
        with open(os.path.join(cg, name), "w") as f:
            f.write(value)
except OSError:
    pass
child = subprocess.Popen(sys.argv[1:])
while True:
    pid, status = os.wait()
    if pid == child.pid:
        break
try:
    with open("/sys/fs/cgroup/pids/cgroup.procs", "w") as f:
        f.write("0")
    os.rmdir(cg)
except OSError:
    pass
sys.exit(os.waitstatus_to_exitcode(status) & 0xFF)
"""


def prepare(module, tests, work):
    """A fresh copy of the repository in `work` whose [tool.mutmut] mutates `module` only and selects `tests`."""
    shutil.rmtree(work, ignore_errors=True)
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                           check=True, capture_output=True, text=True).stdout.split("\0")
    for f in filter(None, files):
        if os.path.isfile(os.path.join(REPO, f)):
            os.makedirs(os.path.dirname(os.path.join(work, f)), exist_ok=True)
            shutil.copy2(os.path.join(REPO, f), os.path.join(work, f))
    configure(module, tests, work)


def share_mutmut(work):
    """Copies the installed mutmut package (and its dist-info) into work/mutants/, next to the mutated package: every
    mutated module imports mutmut's trampoline, and a test that runs the package in a child under another Python and
    uid (the sandbox's non-root cells: /usr/bin/python3 -I -S as an unused uid, with only the tests' repository on its
    sys.path) could not import mutmut from this Python's site-packages (e.g. under /root, 0700): the clean run under
    mutmut failed ("failed to collect stats"). The child's environment has no MUTANT_UNDER_TEST, so the trampoline
    runs the original functions there; mutmut itself (already imported) is not shadowed."""
    import importlib.metadata
    try:
        dist = importlib.metadata.distribution("mutmut")
    except importlib.metadata.PackageNotFoundError:
        return
    for f in dist.files or ():
        src = str(dist.locate_file(f))
        if f.parts[0] in ("..", "__pycache__") or "__pycache__" in f.parts or not os.path.isfile(src):
            continue
        dst = os.path.join(work, "mutants", *f.parts)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy2(src, dst)


def configure(module, tests, work):
    """Writes the repository's pyproject.toml into `work` with [tool.mutmut] mutating `module` only and selecting
    `tests`."""
    path = os.path.join(work, "pyproject.toml")
    text = open(os.path.join(REPO, "pyproject.toml")).read()
    settings = tomllib.loads(text)["tool"]["mutmut"]
    settings.update(only_mutate=[module], pytest_add_cli_args_test_selection=tests)
    section = "[tool.mutmut]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items())
    text = re.sub(r"^\[tool\.mutmut\]\n(?:(?!\[).*\n)*", section, text, flags=re.M)
    open(path, "w").write(text)


def run_module(module, tests, max_children, again=False, skip=()):
    """Runs mutmut on `module` with `tests`; returns {mutant name: status}. again: keep the verdicts of the last run
    in mutants/<name>/, refresh its tests/ and its test selection from the repository and re-run only the mutants not killed (after adding
    tests for survivors: tests are only added, so a killed mutant stays killed). skip: mutant-name globs that
    --again leaves unchecked (reported as such)."""
    work = os.path.join(REPO, "mutants", module.removesuffix(".py").replace("/", "_").replace("*", "all"))
    names = []
    if again and os.path.isdir(work):
        shutil.copytree(os.path.join(REPO, "tests"), os.path.join(work, "tests"), dirs_exist_ok=True)
        configure(module, tests, work)  # the module's test files may have changed too
        # mutmut maps each test to the functions it ran when the test was new: a test edited since (same name, new
        # calls) keeps its old map, so the map is rebuilt from the current tests
        stats = os.path.join(work, "mutants", "mutmut-stats.json")
        if os.path.exists(stats):
            os.remove(stats)
        names = [n for n, s in results_of(work).items()
                 if s not in KILLED and not any(fnmatch.fnmatch(n, g) for g in skip)]
    else:
        prepare(module, tests, work)
    share_mutmut(work)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the mutated copy must be the one imported
    env.setdefault("OMP_NUM_THREADS", "1")  # tiny tests: one thread each is fastest, and the cores are shared
    env["NANOTRAIN_TEST_SHARED_BASE"] = os.path.join(work, "shared_base")  # corpus + tokenizer built once, not per mutant
    if not again or names:
        subprocess.run(contained([MUTMUT, "run", "--max-children", str(max_children), *names]), cwd=work, env=env,
                       check=True)
    return results_of(work)


def contained(argv):
    """argv, or, when this process is root on Linux, argv run in PID, IPC and mount namespaces of its own
    (CONTAIN_INIT: private /tmp, /var/tmp, /dev/shm, /dev/mqueue, a pids cgroup). The sandbox's tests run hostile
    programs meant for a throwaway uid, and a mutant of nanotrain/sandbox/ that loses the uid switch runs them (or the
    sweep's kill(-1, SIGKILL)) as root: on the bare machine that killed every process on it (2026-11-28); inside,
    only this run's processes. Likewise a mutant of the /tmp or SysV IPC clean-up reaches only this run's files and
    objects. Exits (one line) when root has no `unshare` (util-linux) to do it with."""
    if sys.platform != "linux" or os.geteuid() != 0:
        return argv
    unshare = shutil.which("unshare")
    if unshare is None:
        sys.exit("mutation_score.py: as root, mutmut runs in namespaces of its own (see contained()): install "
                 "util-linux's unshare")
    return [unshare, "--pid", "--fork", "--kill-child", "--mount-proc", "--ipc", "--mount", "--propagation",
            "private", sys.executable, "-c", CONTAIN_INIT, *argv]


def results_of(work):
    """{mutant name: status} of the last mutmut run in `work`."""
    out = subprocess.run([MUTMUT, "results", "--all", "true"], cwd=work, check=True, capture_output=True,
                         text=True).stdout
    return dict(line.strip().rsplit(": ", 1) for line in out.splitlines() if ": " in line)


def main():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        modules = tomllib.load(f)["tool"]["mutation_score"]["modules"]
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("modules", nargs="*", help=f"default: all of {list(modules)}")
    parser.add_argument("--max-children", type=int, default=1, help="mutants run in parallel (default 1)")
    parser.add_argument("--min", type=float, default=0.8, help="exit 1 if a module's score is below (default 0.8)")
    parser.add_argument("--again", action="store_true", help="re-run only the mutants the last run did not kill")
    parser.add_argument("--skip", action="append", default=[], metavar="GLOB",
                        help="with --again: leave the mutants whose names match unchecked")
    args = parser.parse_args()
    unknown = [m for m in args.modules if m not in modules]
    if unknown:
        parser.error(f"not in [tool.mutation_score.modules]: {unknown}")
    rows = []
    for module in args.modules or list(modules):
        results = run_module(module, modules[module], args.max_children, args.again, args.skip)
        checked = {n: s for n, s in results.items() if s != "not checked"}
        killed = sum(s in KILLED for s in checked.values())
        timeouts = sum(s == "timeout" for s in checked.values())
        rows.append((module, killed, len(checked), len(results) - len(checked), timeouts,
                     sorted(f"{n} ({s})" for n, s in checked.items() if s not in KILLED)))
    print(f"\n{'module':32} {'killed/total':>12} {'score':>6}  timeouts (in killed)  not checked")
    for module, killed, total, unchecked, timeouts, _ in rows:
        print(f"{module:32} {f'{killed}/{total}':>12} {killed / max(total, 1):>6.1%}  {timeouts:>20}  {unchecked}")
    for module, *_, left in rows:
        if left:
            print(f"\nnot killed in {module}:\n  " + "\n  ".join(left))
    sys.exit(1 if any(killed < args.min * total or unchecked for _, killed, total, unchecked, *_ in rows) else 0)


if __name__ == "__main__":
    main()
