"""Tests of nanotrain.configurator: overrides, types, errors and --help, in-process and through a real script."""

import subprocess
import sys
import textwrap

import pytest

from nanotrain.configurator import ConfigError, apply_overrides, configure, parse_value

pytestmark = pytest.mark.unit

SETTINGS = {"depth": 20, "lr": 0.02, "run": "", "compile": None, "resume": False, "data": "builtin"}


def test_overrides_typed():
    """Each override is parsed as a literal of the default's type (a wrong implementation keeping strings fails)."""
    out = apply_overrides(SETTINGS, ["--depth=4", "--lr=1", "--run=abc", "--compile=True", "--resume=False",
                                     "--data=/tmp/x y"])
    assert out == {"depth": 4, "lr": 1.0, "run": "abc", "compile": True, "resume": False, "data": "/tmp/x y"}
    assert isinstance(out["lr"], float) and isinstance(out["depth"], int)


def test_str_setting_takes_raw_text_and_none_takes_any_literal():
    assert parse_value("run", "123", "") == "123"
    assert parse_value("run", "'quoted'", "") == "quoted"
    assert parse_value("compile", "[1, 2]", None) == [1, 2]
    assert parse_value("compile", "8", None) == 8


@pytest.mark.parametrize("arg,fragment", [
    ("--depth=4.5", "--depth=4.5: expected int"),
    ("--depth=True", "expected int"),
    ("--resume=1", "expected bool"),
    ("--lr=abc", "not a Python literal"),
    ("--deptth=4", "unknown setting --deptth (did you mean --depth?)"),
    ("--zzzzzz=4", "unknown setting --zzzzzz (see --help)"),
    ("depth=4", "malformed argument"),
    ("--depth", "malformed argument"),
    ("--=4", "malformed argument"),
])
def test_errors_name_the_flag(arg, fragment):
    with pytest.raises(ConfigError) as e:
        apply_overrides(SETTINGS, [arg])
    assert fragment in str(e.value)
    assert "\n" not in str(e.value)


SCRIPT = textwrap.dedent('''
    """A toy script."""
    from nanotrain.configurator import configure
    depth = 20  # model depth
    lr = 0.02  # learning rate
    name = "x"  # a name
    config = configure(globals())
    not_a_setting = 5
    print("CONFIG", depth, lr, name, sorted(config))
''')


@pytest.fixture
def script(tmp_path):
    p = tmp_path / "toy.py"
    p.write_text(SCRIPT)
    return p


def run(script, *args):
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=60)


def test_script_override_and_help(script):
    r = run(script, "--depth=4", "--lr=3")
    assert r.returncode == 0, r.stderr
    assert "CONFIG 4 3.0 x ['depth', 'lr', 'name']" in r.stdout
    h = run(script, "--help")
    assert h.returncode == 0
    assert "A toy script." in h.stdout
    assert "--depth = 20" in h.stdout and "model depth" in h.stdout and "learning rate" in h.stdout
    assert "not_a_setting" not in h.stdout


def test_script_bad_flag_exits_nonzero_with_one_line(script):
    r = run(script, "--dept=4")
    assert r.returncode == 2
    assert r.stderr.strip() == "error: unknown setting --dept (did you mean --depth?)"
    assert "CONFIG" not in r.stdout


# ----------------------------------------------------------------------------- ranges (nanotrain.configurator.RULES)
# Through configure() in-process, as a script calls it (a dict stands in for the script's globals), so each test runs
# on the old code too and fails there: the old configure() checked types only.

RANGED = {"run_name": "", "base_run_name": "", "source_run_name": "", "seed": 42, "depth": 20, "max_seq_len": 2048,
          "device_batch_size": None, "total_batch_size": 524288, "num_iterations": None, "batch_size": 64,
          "examples_per_step": 32, "eval_tokens": 1024, "eval_every": 250, "save_every": 1000, "keep_last": 2,
          "step": -1, "max_problems": -1, "max_tokens": 64, "temperature": 0.8, "top_k": 50,
          "matrix_lr": 0.02, "embedding_lr": 0.2, "unembedding_lr": 0.004, "init_lr_frac": 1.0, "final_lr_frac": 0.0,
          "weight_decay": 0.0, "grad_clip": 1.0, "warmup_ratio": 0.0, "warmdown_ratio": 0.2,
          "target_param_data_ratio": 20, "batch_size_margin": 0.85, "device_memory_gb": None, "data": "builtin"}


def configure_error(capsys, settings, *args, **kwargs):
    """configure() on a copy of `settings` with `args`: asserts it exits 2 with one stderr line and returns it."""
    with pytest.raises(SystemExit) as e:
        configure(dict(settings), list(args), **kwargs)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("arg", [
    "--run_name=../../x", "--run_name=/abs/dir", "--run_name=..", "--run_name=.", "--run_name=a/b",
    "--run_name=a b", "--run_name=" + "x" * 101, "--base_run_name=../d4", "--source_run_name=/tmp",
    "--run_name=a\nb",
])
def test_run_names_must_be_plain(capsys, arg):
    """
    Catches a run name that is not a plain directory name: on the old code each was accepted, and base_train with
    --run_name=../../x wrote its run (checkpoints, config, metrics) two levels above <base>/base/, an absolute name
    wrote there. Expects `error: --<flag>=<value>: expected a plain run name ...`, for every setting naming a run.
    """
    flag, value = arg.split("=", 1)
    line = configure_error(capsys, RANGED, arg)
    shown = value if value.isprintable() else repr(value)[1:-1]
    assert line.startswith(f"error: {flag}={shown[:80]}")
    assert "expected a plain run name (letters, digits, '-', '_', '.'; not '.' or '..'" in line
    assert line.endswith("or '' (see --help)")


@pytest.mark.parametrize("arg,expected", [
    ("--embedding_lr=-1", "--embedding_lr=-1.0: expected a finite number >= 0 (a learning rate)"),
    ("--matrix_lr=-0.01", "--matrix_lr=-0.01: expected a finite number >= 0 (a learning rate)"),
    ("--unembedding_lr=1e400", "--unembedding_lr=inf: expected a finite number >= 0 (a learning rate)"),
    ("--init_lr_frac=1.5", "--init_lr_frac=1.5: expected a finite number in (0, 1] (the lrs' multiplier: 0 would "
     "train nothing)"),
    ("--init_lr_frac=0", "--init_lr_frac=0.0: expected a finite number in (0, 1] (the lrs' multiplier: 0 would train "
     "nothing)"),
    ("--final_lr_frac=-0.1", "--final_lr_frac=-0.1: expected a finite number in [0, 1]"),
    ("--weight_decay=-0.1", "--weight_decay=-0.1: expected a finite number >= 0"),
    ("--weight_decay=1e400", "--weight_decay=inf: expected a finite number >= 0"),
    ("--grad_clip=-1", "--grad_clip=-1.0: expected a finite number >= 0 (0 turns clipping off)"),
    ("--warmup_ratio=2", "--warmup_ratio=2.0: expected a finite number in [0, 1] (a fraction of the steps)"),
    ("--target_param_data_ratio=0", "--target_param_data_ratio=0: expected a finite number > 0 (tokens per parameter)"),
    ("--batch_size_margin=0", "--batch_size_margin=0.0: expected a finite number in (0, 1] (a fraction of the device "
     "memory)"),
    ("--device_memory_gb=-2", "--device_memory_gb=-2: expected a finite number > 0 (GiB), or None (see --help)"),
])
def test_learning_rates_and_optimizer_settings_in_range(capsys, arg, expected):
    """
    Catches optimizer settings out of range going through: on the old code --embedding_lr=-1 trained silently,
    --matrix_lr=-0.01 died in Muon with a ValueError traceback, an infinite lr or weight decay made the weights NaN,
    --grad_clip=-1 silently turned clipping off, a fraction above 1 (init_lr_frac, warmup_ratio) scaled the lrs past
    their values, --init_lr_frac=0 (its help says > 0) trained nothing. Every `*_lr` is finite and >= 0, `*_frac` and
    the warmup/warmdown ratios in [0, 1], init_lr_frac in (0, 1].
    """
    assert configure_error(capsys, RANGED, arg) == f"error: {expected}"


@pytest.mark.parametrize("arg,expected", [
    ("--device_batch_size=0", "--device_batch_size=0: expected an int >= 1, or None (see --help)"),
    ("--device_batch_size=[4]", "--device_batch_size=[4]: expected an int >= 1, or None (see --help)"),
    ("--total_batch_size=0", "--total_batch_size=0: expected an int >= 1, or -1 (-1: from the training horizon (base_train))"),
    ("--max_seq_len=-1", "--max_seq_len=-1: expected an int >= 1"),
    ("--depth=0", "--depth=0: expected an int >= 1"),
    ("--num_iterations=0", "--num_iterations=0: expected an int >= 1, or None (see --help)"),
    ("--batch_size=0", "--batch_size=0: expected an int >= 1"),
    ("--examples_per_step=0", "--examples_per_step=0: expected an int >= 1"),
    ("--eval_tokens=0", "--eval_tokens=0: expected an int >= 1"),
    ("--max_tokens=0", "--max_tokens=0: expected an int >= 1"),
    ("--max_problems=0", "--max_problems=0: expected an int >= 1, or -1 (-1 means all)"),
    ("--max_problems=-2", "--max_problems=-2: expected an int >= 1, or -1 (-1 means all)"),
    ("--eval_every=0", "--eval_every=0: expected an int >= 1, or -1 (-1 turns it off)"),
    ("--save_every=-5", "--save_every=-5: expected an int >= 1, or -1 (-1 turns it off)"),
    ("--keep_last=-1", "--keep_last=-1: expected an int >= 0 (0 keeps all)"),
    ("--step=-2", "--step=-2: expected an int >= 0, or -1 (-1 is the newest)"),
    ("--seed=-1", "--seed=-1: expected an int in [0, 2**63)"),
])
def test_batch_sizes_and_counts_in_range(capsys, arg, expected):
    """
    Catches sizes and counts out of range going through: on the old code chat_eval.py --batch_size=0 died with a
    traceback (range() step 0), --max_problems=-2 meant all and 0 none, --eval_every=0 meant off, --keep_last=-1
    and --step=-2 were taken as 0 / the newest, a list for a None-default batch size reached the script, and
    --num_iterations=0 / --depth=0 were refused only after loading the tokenizer, each script with its own words.
    """
    assert configure_error(capsys, RANGED, arg) == f"error: {expected}"


@pytest.mark.parametrize("arg,expected", [
    ("--top_k=-1", "--top_k=-1: expected an int >= 1, or 0 (0 samples among all tokens)"),
    ("--temperature=-0.5", "--temperature=-0.5: expected a finite number >= 0 (0 is greedy)"),
    ("--temperature=1e400", "--temperature=inf: expected a finite number >= 0 (0 is greedy)"),
])
def test_sampling_settings_in_range(capsys, arg, expected):
    """
    Catches sampling settings out of range going through the configurator: on the old code only chat_cli and sample
    had their own checks (in main), an infinite temperature went through everywhere. top_k >= 1 or 0 (all tokens,
    the scripts' "off"), temperature finite and >= 0.
    """
    assert configure_error(capsys, RANGED, arg) == f"error: {expected}"


def test_edge_values_and_sentinels_stay_allowed(capsys):
    """
    The other side of the rules (passes on the old code too): zero lrs (the smoke matrix's negative control), a huge
    finite lr (test_robustness's non-finite run), the fractions' ends, the documented sentinels (-1 off / newest /
    all, 0 keeps all, 0 = all tokens, 0 = greedy, 0 = no clipping), None where the default is None, and "" and plain
    names for every run name.
    """
    args = ["--run_name=d4", "--base_run_name=my-run_1.2", "--source_run_name=", "--matrix_lr=0", "--embedding_lr=1e38",
            "--unembedding_lr=0", "--init_lr_frac=1e-9", "--final_lr_frac=1", "--warmup_ratio=1", "--grad_clip=0",
            "--eval_every=-1", "--save_every=1", "--keep_last=0", "--step=-1", "--max_problems=-1", "--top_k=0",
            "--temperature=0", "--device_batch_size=None", "--num_iterations=1", "--batch_size_margin=1",
            "--device_memory_gb=0.05", "--seed=0"]
    g = dict(RANGED)
    out = configure(g, args)
    assert out["matrix_lr"] == 0.0 and out["embedding_lr"] == 1e38 and out["top_k"] == 0
    assert out["device_batch_size"] is None and out["source_run_name"] == "" and g["base_run_name"] == "my-run_1.2"
    assert "error" not in capsys.readouterr().err


def test_a_bad_default_is_caught(capsys):
    """Catches a script whose own default is out of range (on the old code configure checked only the overrides'
    types, so a negative or NaN default trained): the message says it is the script's default."""
    line = configure_error(capsys, dict(RANGED, embedding_lr=-1.0))
    assert line == ("error: --embedding_lr=-1.0 (the script's default): expected a finite number >= 0 "
                    "(a learning rate)")
    line = configure_error(capsys, dict(RANGED, matrix_lr=float("nan")))
    assert line.startswith("error: --matrix_lr=nan (the script's default): expected a finite number >= 0")


def test_a_script_declares_its_own_rule(capsys):
    """
    configure(..., rules=...) gives one setting a stricter rule (tok_train: vocab_size >= 265) or none (None);
    a rule for a setting the script does not have is a programming error. On the old code configure() had no
    `rules` argument.
    """
    from nanotrain.configurator import ints

    settings = {"vocab_size": 4096, "matrix_lr": 0.02}
    line = configure_error(capsys, settings, "--vocab_size=100", rules={"vocab_size": ints(265, note="bytes")})
    assert line == "error: --vocab_size=100: expected an int >= 265 (bytes)"
    assert configure(dict(settings), ["--matrix_lr=-1"], rules={"matrix_lr": None})["matrix_lr"] == -1.0
    with pytest.raises(ValueError, match="rules for settings the script does not have: lr"):
        configure(dict(settings), [], rules={"lr": None})


def _script_defaults(path):
    """The settings a script declares above its configure() call: {name: default} (constant expressions too)."""
    import ast

    values = {}
    for node in ast.parse(open(path).read()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name == "config":
                break
            try:  # literals, and constant arithmetic such as 20 * 524288
                values[name] = eval(compile(ast.Expression(node.value), path, "eval"), {"__builtins__": {}})
            except Exception:  # noqa: BLE001 - not a setting (an expression of names)
                pass
    return {k: v for k, v in values.items() if not k.startswith("_")}


def _script_rules(path):
    """The script's own rules: the `rules=` dict of its `config = configure(...)` call, evaluated with the configurator's
    names (ints, reals, COUNT, ...) and what the script imports from nanotrain; {} where it passes none."""
    import ast
    import importlib

    import nanotrain.configurator as configurator
    names = vars(configurator).copy()
    for node in ast.parse(open(path).read()).body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nanotrain"):
            module = importlib.import_module(node.module)
            for a in node.names:  # a name, or a submodule (from nanotrain import run)
                names[a.asname or a.name] = (getattr(module, a.name) if hasattr(module, a.name)
                                             else importlib.import_module(f"{node.module}.{a.name}"))
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "config":
            for kw in getattr(node.value, "keywords", []):
                if kw.arg == "rules":
                    return eval(compile(ast.Expression(kw.value), path, "eval"), names)
    return {}


def test_every_numeric_setting_of_every_script_has_a_rule_and_a_valid_default():
    """
    Catches a script setting (int or float) with no range, or a default outside its range (on the old code there were
    no rules). A new setting must reuse a standard name (or suffix), get a rule in RULES, or get one in the script's
    own `configure(..., rules=...)`, which is then the rule its default is checked against.
    """
    import glob
    import os

    from nanotrain.configurator import rule_for, validate

    scripts = sorted(glob.glob(os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "*.py")))
    assert len(scripts) >= 10
    for path in scripts:
        defaults, rules = _script_defaults(path), _script_rules(path)
        assert defaults, path
        missing = [k for k, v in defaults.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                   and rule_for(k, rules) is None]
        assert not missing, (os.path.basename(path), missing)
        validate(defaults, rules=rules)
