"""
The calculator tool the chat model calls while it generates: <|python_start|>expr<|python_end|> is answered by the
engine with <|output_start|>result<|output_end|> (nanotrain.engine). The idea and the token format are nanochat's
(its engine's calculator); the implementation is not: nanochat filters characters and then calls eval() under a
SIGALRM timer, which is silently off outside the main thread. Here the expression is parsed with Python's `ast` and
walked by our own evaluator over a whitelist of node types, with every size bounded, so nothing is ever executed, no
timer is needed and it works from any thread.
"""

import ast
import math
import re

MAX_EXPR_CHARS = 256  # longer expressions are refused (they also bound the parser's nesting)
MAX_NODES = 64  # AST nodes
MAX_ABS_INT = 10**30  # every integer, literal or intermediate, must stay within +-MAX_ABS_INT
MAX_STR_CHARS = 1000  # a string literal (the text of str.count)
OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
       ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b}


class _Refused(Exception):
    """The expression is outside the calculator's language or its bounds."""


def _number(x):
    """x if it is an int within MAX_ABS_INT or a finite float, else _Refused."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise _Refused("not a number")
    if isinstance(x, int) and abs(x) > MAX_ABS_INT:
        raise _Refused("integer too large")
    if isinstance(x, float) and not math.isfinite(x):
        raise _Refused("not finite")
    return x


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, str):
            if len(node.value) > MAX_STR_CHARS:
                raise _Refused("string too long")
            return node.value
        return _number(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        x = _number(_eval(node.operand))
        return -x if isinstance(node.op, ast.USub) else x
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        a, b = _number(_eval(node.left)), _number(_eval(node.right))
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and b == 0:
            raise _Refused("division by zero")
        return _number(OPS[type(node.op)](a, b))
    # "text".count("t"): the one method call, on string literals only
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "count"
            and isinstance(node.func.value, ast.Constant) and isinstance(node.func.value.value, str)
            and len(node.args) == 1 and not node.keywords
            and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
        return _eval(node.func.value).count(_eval(node.args[0]))
    raise _Refused(f"{type(node).__name__} is not allowed")


def _format(x):
    """An int as its digits; a float as an int when it is one (6 / 3 -> "2"), else to 10 significant digits."""
    if isinstance(x, float):
        return str(int(x)) if x.is_integer() and abs(x) < 1e15 else format(x, ".10g")
    return str(x)


def calculate(expr):
    """
    The calculator: the value of `expr` (str), formatted as a str, or None when it cannot be computed.
    The language: int and float literals, + - * / // %, unary minus and plus, parentheses, and
    "string literal".count("string literal") (letter counting); thousands separators in numbers ("1,234") are
    removed first when the expression holds no quote. An int result is exact; a float one is an int when integral
    (6 / 3 -> "2"), else 10 significant digits; str.count gives an int.
    None (never an exception, never a side effect) for: a non-str or non-ASCII input, more than MAX_EXPR_CHARS
    characters or MAX_NODES syntax nodes, anything that does not parse, any name, attribute (other than .count on a
    string literal), call, subscript, comprehension, lambda, power (**) or other operator, booleans, complex numbers,
    division or modulo by zero, an integer beyond MAX_ABS_INT or a non-finite float at any point, and a string literal
    longer than MAX_STR_CHARS. Safe from any thread: no eval, no signals, bounded work.
    """
    if not isinstance(expr, str) or len(expr) > MAX_EXPR_CHARS or not expr.isascii():
        return None
    if "'" not in expr and '"' not in expr:
        expr = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", expr)
    try:
        tree = ast.parse(expr.strip(), mode="eval")
        if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
            return None
        value = _eval(tree)
    except (_Refused, SyntaxError, ValueError, TypeError, OverflowError, RecursionError, MemoryError):
        return None
    return None if isinstance(value, str) else _format(value)  # a bare string literal is not a calculation
