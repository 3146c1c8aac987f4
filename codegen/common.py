"""Code-writing helpers: indented text, expression printers, dtype names."""
from __future__ import annotations

import contextlib
import math

import torch
from sympy.printing.str import StrPrinter

# a kernel's first line where it launches as a programmatic dependent (choices.dependent_launch);
# the wrapper launches a kernel with `launch_pdl` exactly where its source has it
AFTER_PREDECESSOR = "triton_helpers.after_predecessor()"


class IndentedBuffer:
    def __init__(self, indent: int = 0):
        self.lines: list[str] = []
        self.level = indent

    def writeline(self, line: str = "") -> None:
        self.lines.append(("    " * self.level + line) if line else "")

    def writelines(self, lines) -> None:
        for line in lines:
            self.writeline(line)

    def splice(self, other: "IndentedBuffer") -> None:
        for line in other.lines:
            self.writeline(line)

    @contextlib.contextmanager
    def indent(self, n: int = 1):
        self.level += n
        try:
            yield
        finally:
            self.level -= n

    def getvalue(self) -> str:
        return "\n".join(self.lines) + "\n"


class ExprPrinter(StrPrinter):
    """Index expressions as Python/Triton integer arithmetic."""

    def _print_FloorDiv(self, e):
        return f"(({self._print(e.args[0])}) // ({self._print(e.args[1])}))"

    def _print_Mod(self, e):
        return f"(({self._print(e.args[0])}) % ({self._print(e.args[1])}))"

    MAX, MIN, ABS = "max", "min", "abs"  # the functions Max / Min / Abs print as

    def _fold(self, fn, e):
        out = self._print(e.args[0])
        for a in e.args[1:]:
            out = f"{fn}({out}, {self._print(a)})"
        return out

    def _print_Max(self, e):
        return self._fold(self.MAX, e)

    def _print_Min(self, e):
        return self._fold(self.MIN, e)

    def _print_Abs(self, e):
        return f"{self.ABS}({self._print(e.args[0])})"

    def _print_Pow(self, e):
        base, exp = e.args
        if exp.is_Integer and int(exp) > 0:
            return "(" + "*".join([f"({self._print(base)})"] * int(exp)) + ")"
        raise ValueError(f"cannot print {e} as integer arithmetic")

    def _print_Rational(self, e):
        raise ValueError(f"cannot print rational {e} as integer arithmetic")

    def _print_Integer(self, e):
        return str(int(e))

    def _print_Mul(self, e):
        return "*".join(f"({self._print(a)})" if a.is_Add else self._print(a) for a in e.args) \
            if not e.could_extract_minus_sign() else super()._print_Mul(e)

    # torch's float steps in a size (interpolate by a scale factor: TruncToInt(2.0*ToFloat(s0))),
    # computed on the host as torch computes them; a kernel gets such a size as its argument
    FLOAT_STEPS = {"ToFloat": "float({})", "TruncToInt": "int({})", "FloorToInt": "math.floor({})",
                   "CeilToInt": "math.ceil({})", "RoundToInt": "round({})", "FloatTrueDiv": "({} / {})",
                   "IntTrueDiv": "({} / {})", "PowByNatural": "({} ** {})", "FloatPow": "({} ** {})"}

    def _print_Function(self, e):
        form = self.FLOAT_STEPS.get(type(e).__name__)
        if form is None:
            return super()._print_Function(e)
        return form.format(*map(self._print, e.args))


class TritonExprPrinter(ExprPrinter):
    MAX, MIN, ABS = "tl.maximum", "tl.minimum", "tl.abs"

    def _print_Function(self, e):
        if type(e).__name__ in self.FLOAT_STEPS:  # a kernel takes such a size as an argument
            raise ValueError(f"cannot print {e} in a kernel")
        return super()._print_Function(e)

    # Triton's // and % truncate toward zero: floor semantics where the numerator may be negative
    def _print_FloorDiv(self, e):
        if e.args[0].is_nonnegative:
            return super()._print_FloorDiv(e)
        return f"triton_helpers.div_floor({self._print(e.args[0])}, {self._print(e.args[1])})"

    def _print_Mod(self, e):
        if e.args[0].is_nonnegative:
            return super()._print_Mod(e)
        return f"triton_helpers.remainder({self._print(e.args[0])}, {self._print(e.args[1])})"


pexpr = ExprPrinter().doprint
texpr = TritonExprPrinter().doprint

TRITON_DTYPES = {
    torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16",
    torch.float64: "tl.float64", torch.int64: "tl.int64", torch.int32: "tl.int32",
    torch.int16: "tl.int16", torch.int8: "tl.int8", torch.uint8: "tl.uint8", torch.bool: "tl.int1",
}


def triton_dtype(dtype: torch.dtype) -> str:
    if dtype not in TRITON_DTYPES:
        raise NotImplementedError(f"dtype {dtype} in a Triton kernel")
    return TRITON_DTYPES[dtype]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Low-precision floats are computed in fp32."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def literal(value, dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "True" if value else "False"
    if dtype.is_floating_point:
        value = float(value)
        if math.isnan(value):
            return 'float("nan")'
        if math.isinf(value):
            return 'float("inf")' if value > 0 else 'float("-inf")'
        return repr(value)
    bits = torch.iinfo(dtype).bits  # an int out of range wraps, as eager casts it (uint8 > -1: > 255)
    value = int(value) & ((1 << bits) - 1)
    return str(value - (1 << bits) if dtype.is_signed and value >= 1 << (bits - 1) else value)
