"""
Property-based fuzz of the configurator (nanotrain.configurator.apply_overrides): any list of command-line arguments
gives either the settings with values of the declared types, or a ConfigError whose message is one line. Never
another exception (which a script would show as a traceback instead of `error: ...`).
"""

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from nanotrain.configurator import ConfigError, apply_overrides

pytestmark = pytest.mark.unit

SETTINGS = {"depth": 20, "matrix_lr": 0.02, "resume": False, "data": "builtin", "device_batch_size": None,
            "eval_every": -1}
FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None)


def check(args, apply=apply_overrides):
    """The property for apply(SETTINGS, args). Returns "error" or "ok"; raises AssertionError if it is broken, or
    whatever else escaped."""
    try:
        out = apply(SETTINGS, args)
    except ConfigError as e:
        msg = str(e)
        assert msg and len(msg.splitlines()) == 1, f"not one line: {msg!r}"
        return "error"
    assert out.keys() == SETTINGS.keys()
    for name, value in out.items():
        default = SETTINGS[name]
        if default is None:  # documented: a None default takes any literal
            continue
        want = type(default)
        assert type(value) is want, f"--{name}: {type(value).__name__} for a {want.__name__} setting"
    return "ok"


# one-line text: no control characters (Cc holds \n \r \x0b \x0c \x1c-\x1e \x85) and no line/paragraph separators
ONE_LINE_TEXT = st.text(st.characters(blacklist_categories=("Cc", "Zl", "Zp", "Cs")), max_size=24)
SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | ONE_LINE_TEXT
FLAT_LITERALS = (SCALARS | st.lists(SCALARS, max_size=4) | st.tuples(SCALARS, SCALARS)
                 | st.dictionaries(st.integers() | ONE_LINE_TEXT, SCALARS, max_size=3)).map(repr)
NAMES = st.sampled_from(sorted(SETTINGS)) | st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}", fullmatch=True) | ONE_LINE_TEXT
ONE_LINE_ARG = (st.tuples(NAMES, FLAT_LITERALS | ONE_LINE_TEXT).map(lambda nv: f"--{nv[0]}={nv[1]}")
                | ONE_LINE_TEXT | ONE_LINE_TEXT.map(lambda t: "--" + t))


@FUZZ
@given(st.lists(ONE_LINE_ARG, max_size=4))
@example(["--depth=4", "--matrix_lr=1", "--resume=True", "--data=/some dir/*.parquet", "--device_batch_size=8"])
@example(["--depth=4.5"])
@example(["--deptth=4"])
@example(["depth=4"])
@example(["--=1"])
@example(["--resume=1"])
@example(["--matrix_lr=1e400", "--eval_every=-0", "--depth=0x10", "--depth=1_000"])
@example(["--depth=" + "9" * 5000])
@example(["--depth=(((((((((())))))))))"])
@example(["--data=" + "\u00e9\u4e2d\U0001F600", "--ñ=1"])
def test_fuzz_one_line_arguments(args):
    """
    Random names (known, unknown, not identifiers) and one-line values (flat literals of every type, random text,
    huge ints) give typed settings or a one-line ConfigError. Catches a type slipping through (an int for a bool, a
    bool for an int), an unknown name accepted, or an exception other than ConfigError. The sensitivity of the
    property itself is exercised in test_the_property_catches_wrong_types.
    """
    check(args)


def test_the_property_catches_wrong_types():
    """The check is not vacuous: a configurator that skipped the type check (here: the raw dict update) fails it."""
    def no_type_check(settings, args):
        return dict(settings, **{a[2:].split("=", 1)[0]: a.split("=", 1)[1] for a in args})
    with pytest.raises(AssertionError, match="str for a int setting"):
        check(["--depth=4"], apply=no_type_check)
    assert check(["--depth=4"]) == "ok" and check(["--depth=x"]) == "error"


def known(arg, id, why):
    """A bad input the fuzz once found (`why`: what escaped before the fix)."""
    return pytest.param(arg, id=id)


@pytest.mark.parametrize("arg", [
    known("--depth={[1]: 2}", "unhashable-key-int-setting", "TypeError escapes"),
    known("--data={[]: 1}", "unhashable-key-str-setting", "TypeError escapes"),
    known("--device_batch_size={{}}", "unhashable-set-item-none-setting", "TypeError escapes"),
    known("--depth=1\n2", "newline-in-value", "the raw value makes the message 2 lines"),
    known("--matrix_lr=\r", "carriage-return-value", "the raw value makes the message 2 lines"),
    known("--depth=" + "-" * 100_000 + "1", "deep-unary-nesting", "MemoryError from the parser escapes"),
    known("--depth=" + "1+" * 100_000 + "1", "deep-binop-nesting", "RecursionError escapes"),
])
def test_known_bad_values(arg):
    """
    Inputs the full fuzz found, each a typed value (a str setting takes the raw text) or a one-line error once fixed:
    an unhashable dict key or set element (TypeError from ast.literal_eval, for int, str and None settings), a value
    with a line break (the message repeats the raw value, so it spans two lines), and deeply nested expressions
    (MemoryError / RecursionError from the parser).
    """
    assert check([arg]) in ("ok", "error")


ANY_TEXT_ARG = st.tuples(NAMES, st.text(max_size=24) | FLAT_LITERALS).map(lambda nv: f"--{nv[0]}={nv[1]}")


@FUZZ
@given(st.lists(ANY_TEXT_ARG | st.text(max_size=24), max_size=4))
@example(["--depth={[1]: 2}"])
@example(["--depth=1\n2"])
def test_fuzz_any_text(args):
    """The full property on any text, control characters and nested literals included."""
    check(args)


RANGED = {"run_name": "", "base_run_name": "", "matrix_lr": 0.02, "init_lr_frac": 1.0, "top_k": 50,
          "temperature": 0.8, "device_batch_size": None, "eval_every": -1, "step": -1, "seed": 42}


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(sorted(RANGED)), FLAT_LITERALS | st.text(max_size=24))
                .map(lambda nv: f"--{nv[0]}={nv[1]}"), max_size=4))
@example(["--run_name=../../x"])
@example(["--run_name=/abs/dir", "--matrix_lr=-0.01"])
@example(["--base_run_name=..", "--top_k=-1", "--matrix_lr=1e400"])
@example(["--run_name=a\\b", "--run_name=x\x00y", "--run_name=.\n."])
def test_fuzz_ranges(args):
    """
    configure()'s range check (nanotrain.configurator.validate) after the parse, on random values of settings with
    rules: a one-line ConfigError, or values that are in range, checked here without the rules' own code: every run
    name accepted ("" aside) is one directory level below the stage directory, every number finite and on its side of
    the bounds. On the old code (no range check) `--run_name=../../x` and `--matrix_lr=-0.01` came back as values.
    """
    import math
    import os

    from nanotrain.configurator import validate

    try:
        out = apply_overrides(RANGED, args)
        validate(out, RANGED)
    except ConfigError as e:
        assert str(e) and len(str(e).splitlines()) == 1, f"not one line: {str(e)!r}"
        return
    for name in ("run_name", "base_run_name"):
        v = out[name]
        stage = os.path.join(os.sep, "base", "stage")
        assert v == "" or os.path.dirname(os.path.normpath(os.path.join(stage, v))) == stage, (name, v)
        assert v == "" or os.path.basename(v) == v and "\\" not in v and v.isprintable(), (name, v)
    assert math.isfinite(out["matrix_lr"]) and out["matrix_lr"] >= 0
    assert 0 < out["init_lr_frac"] <= 1 and math.isfinite(out["temperature"]) and out["temperature"] >= 0
    assert type(out["top_k"]) is int and out["top_k"] >= 0
    assert out["device_batch_size"] is None or (type(out["device_batch_size"]) is int and out["device_batch_size"] >= 1)
    assert out["eval_every"] == -1 or out["eval_every"] >= 1
    assert out["step"] >= -1 and 0 <= out["seed"] < 2**63
