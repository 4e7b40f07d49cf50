"""Tests of nanotrain.configurator: overrides, types, errors and --help, in-process and through a real script."""

import subprocess
import sys
import textwrap

import pytest

from nanotrain.configurator import ConfigError, apply_overrides, parse_value

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
