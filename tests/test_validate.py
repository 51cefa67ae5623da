"""Tests for minifloat.core.validate: every validator raises ValueError naming the field and the value."""

from __future__ import annotations

import math

import pytest

from minifloat.core.validate import check_bool, check_choice, check_int, check_number

# (name, call, message; None: accepted)
CASES = [
    ("bool-ok", lambda: check_bool("resume", False), None),
    ("bool-int", lambda: check_bool("resume", 1), "resume must be a bool, got 1"),
    ("int-ok", lambda: check_int("steps", 3, low=1), None),
    ("int-low", lambda: check_int("steps", 0, low=1), "steps must be an int >= 1, got 0"),
    ("int-float", lambda: check_int("steps", 2.0, low=1), "steps must be an int >= 1, got 2.0"),
    ("int-bool", lambda: check_int("steps", True), "steps must be an int, got True"),
    ("int-range", lambda: check_int("warmup", 9, low=2, high=8), "warmup must be an int in [2, 8], got 9"),
    ("int-none-ok", lambda: check_int("cap", None, low=2, allow_none=True), None),
    ("int-none", lambda: check_int("cap", None, low=2), "cap must be an int >= 2, got None"),
    ("int-or-none", lambda: check_int("cap", 1, low=2, allow_none=True), "cap must be an int >= 2 or None, got 1"),
    ("number-ok", lambda: check_number("lr", 3e-4, low=0, low_open=True), None),
    ("number-open-low", lambda: check_number("lr", 0.0, low=0, low_open=True),
     "lr must be a finite number > 0, got 0.0"),
    ("number-nan", lambda: check_number("lr", math.nan, low=0), "lr must be a finite number >= 0, got nan"),
    ("number-inf", lambda: check_number("lr", math.inf), "lr must be a finite number, got inf"),
    ("number-str", lambda: check_number("lr", "1e-3"), "lr must be a finite number, got '1e-3'"),
    ("number-bool", lambda: check_number("lr", True), "lr must be a finite number, got True"),
    ("number-half-open", lambda: check_number("alpha", 1.5, low=0, high=1, low_open=True),
     "alpha must be a finite number in (0, 1], got 1.5"),
    ("number-open", lambda: check_number("p", 1.0, low=0, high=1, low_open=True, high_open=True),
     "p must be a finite number in (0, 1), got 1.0"),
    ("number-high", lambda: check_number("cos", -2.0, high=1), None),
    ("number-high-bad", lambda: check_number("cos", 2.0, high=1), "cos must be a finite number <= 1, got 2.0"),
    ("number-none-ok", lambda: check_number("clip", None, low=0, allow_none=True), None),
    ("choice-ok", lambda: check_choice("mode", "fp8", ("fp8", "bf16")), None),
    ("choice-bad", lambda: check_choice("mode", "fp16", ("fp8", "bf16")),
     "mode must be one of ['fp8', 'bf16'], got 'fp16'"),
]


@pytest.mark.parametrize("name, call, message", CASES, ids=[c[0] for c in CASES])
def test_validators(name, call, message):
    if message is None:
        call()
        return
    with pytest.raises(ValueError) as info:
        call()
    assert str(info.value) == message
