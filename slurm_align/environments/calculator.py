"""A safe arithmetic evaluator for model-written expressions: Python's ast, walked by hand.

Allowed: int and float literals, + - * / // % **, unary + and -, parentheses. Nothing else
parses to an allowed node (names, calls, attributes, subscripts, strings, comparisons,
lambdas...), so no code runs: there is no eval. Sizes are bounded so that `9**9**9` or a
product of huge numbers cannot take the rank's memory or time: integers stay under MAX_BITS
bits, the expression under MAX_CHARS characters.
"""

from __future__ import annotations

import ast
import math
import operator

MAX_CHARS = 1000
MAX_BITS = 4096          # about 1233 decimal digits
ALLOWED = "numbers and + - * / // % ** ( )"


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or its value is out of bounds."""


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_SYMBOL = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**"}


def _bits(x: int | float) -> float:
    """log2 of |x| (0 for |x| <= 1), for bounding results before computing them."""
    x = abs(x)
    if x <= 1:
        return 0.0
    return float(x.bit_length()) if isinstance(x, int) else math.log2(x)


def _check_size(op: type, a, b) -> None:
    if op is ast.Pow:
        if isinstance(b, int) and isinstance(a, int) and b > 0 and _bits(a) * b > MAX_BITS:
            raise CalculatorError(f"{a} ** {b} is too large (over {MAX_BITS} bits)")
        if abs(b) > 10 * MAX_BITS:
            raise CalculatorError(f"exponent {b} is too large")
    elif op is ast.Mult and isinstance(a, int) and isinstance(b, int) and _bits(a) + _bits(b) > MAX_BITS:
        raise CalculatorError(f"the product is too large (over {MAX_BITS} bits)")


def _eval(node: ast.AST):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if isinstance(node.value, int) and _bits(node.value) > MAX_BITS:
            raise CalculatorError(f"number too large (over {MAX_BITS} bits)")
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else +value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _eval(node.left), _eval(node.right)
        _check_size(type(node.op), a, b)
        try:
            value = _BINARY[type(node.op)](a, b)
        except ZeroDivisionError:
            raise CalculatorError(f"division by zero in {a} {_SYMBOL[type(node.op)]} {b}") from None
        except OverflowError:
            raise CalculatorError(f"{a} {_SYMBOL[type(node.op)]} {b} overflows") from None
        if isinstance(value, complex):   # (-8) ** 0.5
            raise CalculatorError(f"{a} ** {b} is not a real number")
        if isinstance(value, float) and not math.isfinite(value):
            raise CalculatorError(f"{a} {_SYMBOL[type(node.op)]} {b} is not finite")
        return value
    what = type(node).__name__
    if isinstance(node, ast.Name):
        what = f"name {node.id!r}"
    elif isinstance(node, ast.Constant):
        what = f"{type(node.value).__name__} {node.value!r}"
    raise CalculatorError(f"{what} is not allowed: only {ALLOWED}")


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; CalculatorError says what is wrong otherwise."""
    if not isinstance(expression, str):
        raise CalculatorError(f"expected the expression as a string, got {type(expression).__name__}")
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"not an arithmetic expression ({e.msg}); use {ALLOWED}") from None
    except (RecursionError, MemoryError, ValueError):
        raise CalculatorError("expression nested too deeply") from None
    try:
        return _eval(tree.body)
    except RecursionError:
        raise CalculatorError("expression nested too deeply") from None


def format_value(value: int | float) -> str:
    """The value as the model reads it: integers exactly, integral floats without '.0'."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
        return str(int(value))
    return repr(value)
