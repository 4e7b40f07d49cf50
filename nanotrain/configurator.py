"""
The configurator: a script declares its settings as plain module globals, each with a one-line comment, e.g.

    depth = 20  # model depth: n_layer; model_dim = depth * 64
    ...
    config = configure(globals())

and `--name=value` on the command line overrides them. The value is parsed as a Python literal and must have the
default's type (an int is accepted for a float; a None default takes any literal; a str default takes the raw text).
`--help` prints every setting with its default and comment. In the spirit of nanoGPT's "poor man's configurator",
but with errors that name the flag and what was expected instead of asserts.

The ranges of the settings live here too, in one place (RULES, rule_for): a setting name means the same thing in every
script (`*_lr` is a learning rate, `run_name` / `*_run_name` a run name, `device_batch_size` a count of rows, ...), so
the rule is keyed by the name, and configure() checks every final value, defaults included, before the script sees
it. A script declares an extra or different rule for one of its settings with configure(..., rules={name: Rule})
(None: no rule). A None default's None always passes (its meaning is the script's, in the setting's comment).
"""

import ast
import difflib
import io
import math
import os
import re
import sys
import tokenize

from nanotrain.common import die, print0

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
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
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


# ----------------------------------------------------------------------------- ranges of the settings


class Rule:
    """The range of a setting: ok(value) -> bool, and `allowed`, the text of the error message after "expected"."""

    def __init__(self, allowed, ok):
        self.allowed = allowed
        self.ok = ok

    def __repr__(self):
        return f"Rule({self.allowed!r})"


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v):
    """An int or float (not a bool) that is finite."""
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def ints(lo, also=None, note=""):
    """An int >= lo, or the sentinel `also` (an int); `note` says what the sentinel or the range means."""
    text = f"an int >= {lo}" + (f", or {also}" if also is not None else "") + (f" ({note})" if note else "")
    return Rule(text, lambda v: _is_int(v) and (v >= lo or v == also))


def reals(lo, hi=None, lo_open=False, note=""):
    """A finite int or float >= lo (> lo with lo_open) and <= hi."""
    if hi is None:
        text = f"a finite number {'>' if lo_open else '>='} {lo}"
    else:
        text = f"a finite number in {'(' if lo_open else '['}{lo}, {hi}]"
    text += f" ({note})" if note else ""
    return Rule(text, lambda v: _is_real(v) and (v > lo if lo_open else v >= lo) and (hi is None or v <= hi))


RUN_NAME_CHARS = re.compile(r"[A-Za-z0-9_.-]+")
RUN_NAME_MAX = 100


def run_name_rule(required=False):
    """
    A run name: a plain directory name under <base_dir>/<stage>/ (letters, digits, '-', '_', '.'; not '.' or '..'; at
    most RUN_NAME_MAX characters), so that a run never writes outside its stage directory. With required=False the
    empty name is allowed too: every script gives "" a meaning (the newest run, or a name derived from another one).
    """
    text = f"a plain run name (letters, digits, '-', '_', '.'; not '.' or '..'; at most {RUN_NAME_MAX} characters)"
    if not required:
        text += ", or '' (see --help)"

    def ok(v):
        if not isinstance(v, str):
            return False
        if v == "":
            return not required
        return len(v) <= RUN_NAME_MAX and v not in (".", "..") and RUN_NAME_CHARS.fullmatch(v) is not None
    return Rule(text, ok)


COUNT = ints(1)
LEARNING_RATE = reals(0, note="a learning rate")
FRACTION = reals(0, 1)
EVERY = ints(1, also=-1, note="-1 turns it off")

# a setting name means one thing in every script: its range, by exact name, then by suffix (SUFFIX_RULES)
RULES = {
    "run_name": run_name_rule(),
    "seed": Rule("an int in [0, 2**63)", lambda v: _is_int(v) and 0 <= v < 2**63),  # torch.manual_seed's range
    # model and batch sizes
    "depth": COUNT,
    "max_seq_len": COUNT,
    "vocab_size": COUNT,
    "device_batch_size": COUNT,
    "total_batch_size": ints(1, also=-1, note="-1: from the training horizon (base_train)"),
    "max_batch_size": COUNT,
    "manual_batch_size": COUNT,
    "batch_size": COUNT,
    "examples_per_step": COUNT,
    "max_tokens_per_device": COUNT,
    "max_conversations_per_device": COUNT,
    "world_size": COUNT,
    "batch_size_margin": reals(0, 1, lo_open=True, note="a fraction of the device memory"),
    "margin": reals(0, 1, lo_open=True, note="a fraction of the device memory"),
    "device_memory_gb": reals(0, lo_open=True, note="GiB"),
    # training horizon and optimizer
    "num_iterations": COUNT,
    "target_param_data_ratio": reals(0, lo_open=True, note="tokens per parameter"),
    "weight_decay": reals(0),
    "muon_weight_decay": reals(0),
    "muon_beta2": Rule("a finite number in [0, 1) (0 turns NorMuon off)", lambda v: _is_real(v) and 0 <= v < 1),
    "embedding_beta2": Rule("a finite number in [0, 1)", lambda v: _is_real(v) and 0 <= v < 1),
    "unembedding_beta2": Rule("a finite number in [0, 1)", lambda v: _is_real(v) and 0 <= v < 1),
    "momentum": Rule("a finite number in [0, 1)", lambda v: _is_real(v) and 0 <= v < 1),
    "final_momentum": Rule("a finite number in [0, 1)", lambda v: _is_real(v) and 0 <= v < 1),
    "momentum_warmup": ints(0, note="steps; 0: none"),
    "row_packing": Rule("'contiguous', 'best_fit' or 'bos_aligned'",  # nanotrain.dataloader.ROW_PACKINGS
                        lambda v: v in ("contiguous", "best_fit", "bos_aligned")),
    "rotary_base": reals(1, lo_open=True),
    "qk_scale": reals(0, lo_open=True),
    "window_pattern": Rule("a non-empty string of S (short window) and L (full attention), e.g. SSSL",
                           lambda v: isinstance(v, str) and v != "" and set(v) <= {"S", "L"}),
    "short_window": ints(1, note="tokens before the query a short-window layer attends to"),
    "grad_clip": reals(0, note="0 turns clipping off"),
    "warmup_ratio": reals(0, 1, note="a fraction of the steps"),
    "lr_warmup_steps": ints(0, note="optimizer steps"),
    "target_flops": Rule("-1, or a finite number > 0 (FLOPs)", lambda v: v == -1 or (_is_real(v) and v > 0)),
    "warmdown_ratio": reals(0, 1, note="a fraction of the steps"),
    "init_lr_frac": reals(0, 1, lo_open=True, note="the lrs' multiplier: 0 would train nothing"),
    "osft_rank_ratio": Rule("a number in [0, 1) (0 turns OSFT off)", lambda v: _is_real(v) and 0 <= v < 1),
    # evaluation, checkpoints
    "eval_tokens": COUNT,
    "eval_examples": COUNT,
    "keep_last": ints(0, note="0 keeps all"),
    "step": ints(0, also=-1, note="-1 is the newest"),
    "max_problems": ints(1, also=-1, note="-1 means all"),
    "max_per_task": ints(1, also=-1, note="-1 means all"),
    "core_max_per_task": ints(1, also=-1, note="-1 means all"),
    # sampling
    "max_tokens": COUNT,
    "max_new_tokens": COUNT,
    "num_samples": COUNT,
    "eval_problems": COUNT,
    "temperature": reals(0, note="0 is greedy"),
    "top_k": ints(1, also=0, note="0 samples among all tokens"),
    # tokenizer training, benchmarks
    "max_chars": COUNT,
    "doc_cap": COUNT,
    "tokenizer_chars": COUNT,
    "steps": COUNT,
    "warmup_steps": ints(0),
    "pairs": COUNT,
    "pair_steps": COUNT,
    "threads": ints(0, note="0 keeps torch's default"),
    "prefetch": ints(0, also=-1, note="-1 is the loader's default"),
    "loader_seconds": reals(0, lo_open=True),
    "budget_s": reals(0, lo_open=True, note="seconds"),  # gpu_check: wall-clock seconds for the whole check
    "d20_steps": COUNT,  # gpu_check: optimizer steps of the depth-20 run after the batch-size discovery
    # the server (scripts/chat_serve.py)
    "port": ints(0, note="0 picks a free port"),
    "context_len": ints(0, note="0: the model's max_seq_len"),
    "max_batch": ints(0, note="0: from the KV cache's memory"),
    "num_gpus": COUNT,
    "max_queue": ints(0, note="0: 2 x max_batch"),
    "max_body_bytes": COUNT,
    "prefill_chunk": COUNT,  # prompt tokens prefilled per decode step at most
    "idle_timeout": reals(0, lo_open=True, note="seconds"),
    "max_connections": ints(0, note="0: from the open-file limit"),
    "max_messages": COUNT,
    "rounds": COUNT,  # serve_bench: rounds per concurrency
    "cpu_threads": ints(0, note="0: every core but one"),
}
SUFFIX_RULES = (
    ("_run_name", run_name_rule()),  # base_run_name, source_run_name, ...
    ("_lr", LEARNING_RATE),  # matrix_lr, embedding_lr, unembedding_lr, ...
    ("_frac", FRACTION),  # final_lr_frac: a multiplier of the learning rates, in [0, 1]
    ("_every", EVERY),  # eval_every, sample_every, save_every
    ("_max_problems", RULES["max_problems"]),  # chatcore_max_problems: problems per task, -1 means all
)


def rule_for(name, rules=None):
    """The Rule of setting `name`: the script's own (`rules`, where None means none), else RULES, else SUFFIX_RULES,
    else None (no range: strings with their own checks, bools)."""
    if rules and name in rules:
        return rules[name]
    if name in RULES:
        return RULES[name]
    return next((rule for suffix, rule in SUFFIX_RULES if name.endswith(suffix)), None)


def validate(values, defaults=None, rules=None):
    """
    Checks every setting of `values` (name -> value) against its Rule (rule_for). `defaults` (name -> default): a
    value of None passes where the default is None, and a value equal to its default is called the default in the
    message. `rules`: the script's own rules, {name: Rule or None}, for settings of `values`. Raises ConfigError, one
    line: `--name=value: expected <what is allowed>`.
    """
    defaults = values if defaults is None else defaults
    unknown = sorted(set(rules or ()) - set(values))
    if unknown:
        raise ValueError(f"rules for settings the script does not have: {', '.join(unknown)}")
    for name, value in values.items():
        rule = rule_for(name, rules)
        if rule is None:
            continue
        none_ok = name not in defaults or defaults[name] is None
        if (value is None and none_ok) or rule.ok(value):
            continue
        default = defaults.get(name)
        is_default = defaults is not values and name in defaults and (
            value is default or (type(value) is type(default) and value == default))
        where = " (the script's default)" if is_default else ""
        allowed = rule.allowed + (", or None (see --help)" if none_ok else "")
        shown = _shown(value if isinstance(value, str) else str(value) if _is_real(value) else repr(value))
        raise ConfigError(f"--{name}={shown}{where}: expected {allowed}")


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


def configure(g, argv=None, none_types=None, rules=None):
    """
    Reads the settings of the script whose module globals are `g` (the plain literal globals assigned above the
    call), applies `--name=value` overrides from `argv` (default sys.argv[1:]) back into `g`, handles `--help`
    (prints every setting and exits 0), checks every final value (defaults included) against its range (validate),
    and returns the final settings as a dict. none_types: {name: tuple of types} allowed for settings whose default
    is None (None itself is always allowed). rules: {name: Rule, or None for no rule} where a setting of this script
    needs a range other than its name's (rule_for). A bad argument or value prints `error: <one line>` and exits
    with code 2.
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
        validate(final, settings, rules)
    except ConfigError as e:
        die(str(e))  # `error: ...` on rank 0, exit code 2
    for k, v in final.items():
        if v != settings[k] or type(v) is not type(settings[k]):
            print0(f"Overriding: {k} = {v!r}", file=sys.stderr)  # stderr: keeps a one-shot answer on stdout clean
        g[k] = v
    return final
