"""The run-id rule of the contract, written once: every reader and writer uses it.

`run_id` is 1..128 characters of ASCII letters, digits and `._:-`. A second copy
of this rule (an `isalnum()` check, which accepts any Unicode letter) once let a
key such as `café` through to an event constructor that refused it, and the
sink crashed on that message at every restart.
"""

from __future__ import annotations

import re

RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,128}")
RUN_ID_RULE = "1..128 characters of A-Z a-z 0-9 . _ : -"


def is_valid_run_id(value: object) -> bool:
    """True for a string the contract accepts as a run id (ASCII only)."""
    return isinstance(value, str) and RUN_ID_PATTERN.fullmatch(value) is not None
