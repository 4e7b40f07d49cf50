"""
The configurator: a script declares its settings as plain module globals, each with a one-line comment, e.g.

    depth = 20  # model depth: n_layer; model_dim = depth * 64
    ...
    config = configure(globals())

and `--name=value` on the command line overrides them. The value is parsed as a Python literal and must have the
default's type (an int is accepted for a float; a None default takes any literal; a str default takes the raw text).
`--help` prints every setting with its default and comment. In the spirit of nanoGPT's "poor man's configurator",
but with errors that name the flag and what was expected instead of asserts.
"""

import ast
import difflib
import io
import os
import sys
import tokenize

from nanotrain.common import print0

SETTING_TYPES = (int, float, bool, str, type(None))
LITERAL_ERRORS = (ValueError, SyntaxError, TypeError, MemoryError, RecursionError)  # ast.literal_eval on any text


class ConfigError(Exception):
    """A bad command-line argument; the message is one line naming the flag and what was expected."""


def _declared_settings(source, stop_line):
    """
    Top-level `name = <literal>` assignments before line `stop_line` of a script's source, with their trailing
    comments. Returns {name: comment} in source order.
    """
    tree = ast.parse(source)
    comments = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    settings = {}
    for node in tree.body:
        if node.lineno >= stop_line:
            break
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name.startswith("_"):
                continue
            settings[name] = comments.get(node.end_lineno, comments.get(node.lineno, ""))
    return settings


def _shown(raw, limit=80):
    """`raw` as it appears in a one-line message: escaped if it holds line breaks or control characters, and cut."""
    text = raw if raw.isprintable() else repr(raw)[1:-1]
    return text if len(text) <= limit else text[:limit] + "..."


def _type_name(value):
    return "None" if value is None else type(value).__name__


def parse_value(name, raw, default, none_types=None):
    """
    Parses the text `raw` given for setting `name` against its `default`. Returns the typed value.
    A None default takes any literal, or only None and `none_types` (a tuple of types) when given.
    Raises ConfigError when the literal is malformed or of the wrong type.
    """
    if isinstance(default, str):
        # a str setting takes the raw text; a quoted literal is unquoted
        try:
            value = ast.literal_eval(raw)
            if isinstance(value, str):
                return value
        except LITERAL_ERRORS:
            pass
        return raw
    try:
        value = ast.literal_eval(raw)
    except LITERAL_ERRORS:
        raise ConfigError(f"--{name}={_shown(raw)}: not a Python literal; expected {_type_name(default)} "
                          f"(default {default!r})") from None
    if default is None:
        if none_types and value is not None and type(value) not in none_types:
            if not (float in none_types and type(value) is int):
                expected = " or ".join(t.__name__ for t in none_types)
                raise ConfigError(f"--{name}={_shown(raw)}: expected {expected} or None, got {_type_name(value)}")
            value = float(value)
        return value
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"--{name}={_shown(raw)}: expected bool (True or False), got {_type_name(value)}")
        return value
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if type(value) is not type(default):
        raise ConfigError(f"--{name}={_shown(raw)}: expected {_type_name(default)} (default {default!r}), "
                          f"got {_type_name(value)}")
    return value


def apply_overrides(settings, args, none_types=None):
    """
    Applies `--name=value` strings in `args` to the dict `settings` (name -> default) and returns the new dict.
    none_types: {name: tuple of types} for settings whose default is None.
    Raises ConfigError for a malformed argument, an unknown name (with the closest known name) or a wrong type.
    """
    out = dict(settings)
    for arg in args:
        if not arg.startswith("--") or "=" not in arg:
            raise ConfigError(f"malformed argument {arg!r}: expected --name=value (see --help)")
        name, raw = arg[2:].split("=", 1)
        if not name.isidentifier():
            raise ConfigError(f"malformed argument {arg!r}: expected --name=value with a setting name (see --help)")
        if name not in settings:
            close = difflib.get_close_matches(name, list(settings), n=1, cutoff=0.5)
            hint = f" (did you mean --{close[0]}?)" if close else " (see --help)"
            raise ConfigError(f"unknown setting --{name}{hint}")
        out[name] = parse_value(name, raw, settings[name], (none_types or {}).get(name))
    return out


def format_help(doc, settings, comments):
    """The --help text: the script's docstring, then one line per setting with its default and comment."""
    lines = []
    if doc:
        lines += [doc.strip(), ""]
    lines.append("Settings (override with --name=value):")
    width = max((len(k) for k in settings), default=0)
    for k, v in settings.items():
        lines.append(f"  --{k:<{width}} = {v!r:<14} {comments.get(k, '')}".rstrip())
    return "\n".join(lines)


def configure(g, argv=None, none_types=None):
    """
    Reads the settings of the script whose module globals are `g` (the plain literal globals assigned above the
    call), applies `--name=value` overrides from `argv` (default sys.argv[1:]) back into `g`, handles `--help`
    (prints every setting and exits 0), and returns the final settings as a dict. none_types: {name: tuple of
    types} allowed for settings whose default is None (None itself is always allowed). A bad argument prints
    `error: <one line>` and exits with code 2.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    argv = [a for a in argv if a != "--"]  # `torchrun script.py -- --name=value` passes the separator through
    path = g.get("__file__")
    source = open(path).read() if path and os.path.exists(path) else ""
    # settings are the assignments above the configure(...) call
    caller = sys._getframe(1)
    stop_line = caller.f_lineno if caller.f_globals is g else 10**9
    comments = _declared_settings(source, stop_line) if source else {}
    names = comments if comments else [k for k in g if not k.startswith("_")]
    settings = {k: g[k] for k in names if k in g and isinstance(g[k], SETTING_TYPES)}
    if "--help" in argv or "-h" in argv:
        print(format_help(g.get("__doc__"), settings, comments))
        sys.exit(0)
    try:
        final = apply_overrides(settings, argv, none_types)
    except ConfigError as e:
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    for k, v in final.items():
        if v != settings[k] or type(v) is not type(settings[k]):
            print0(f"Overriding: {k} = {v!r}", file=sys.stderr)  # stderr: keeps a one-shot answer on stdout clean
        g[k] = v
    return final
