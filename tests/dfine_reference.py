"""Independent references of D-FINE's distribution maths for the tests, written from
docs/dfine.md (not from the package)."""

from __future__ import annotations


def naive_bin_values(reg_max: int, up: float, reg_scale: float) -> list[float]:
    """The weighting function W(n), n = 0 .. N (N = ``reg_max``), one value at a time:
    a = |up| |reg_scale|, s = (a + 1)^(2 / (N - 2)); W(0) = -2a, W(N) = 2a, W(N/2) = 0,
    W(n) = -(s^(N/2 - n) - 1) below N/2 and s^(n - N/2) - 1 above."""
    a = abs(up) * abs(reg_scale)
    s = (a + 1) ** (2 / (reg_max - 2))
    half = reg_max // 2
    values = []
    for n in range(reg_max + 1):
        if n == 0:
            values.append(-2 * a)
        elif n == reg_max:
            values.append(2 * a)
        elif n < half:
            values.append(-(s ** (half - n) - 1))
        elif n == half:
            values.append(0.0)
        else:
            values.append(s ** (n - half) - 1)
    return values
