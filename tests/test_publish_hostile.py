"""`publish` reads bytes: a line that is not UTF-8, or whose strings could not be stored (a lone
surrogate, a NUL), is dead-lettered with the reason, the good lines are published, exit 2."""

from __future__ import annotations

import base64
import json
import subprocess

import pytest

from areal_metrics.producers.contract.events import parse_event
from tests.kafka_reading import read_to_end
from tests.support import CLI


@pytest.mark.broker
def test_publish_dead_letters_lines_that_could_not_be_stored(stack_env, topics, kafka_bootstrap):
    good = b'{"type":"command","run_id":"r1","command":"evaluate_now","reason":"ok \\u202e\\ud83d\\ude00"}'
    not_utf8 = b'{"type":"command","run_id":"r1","command":"stop","reason":"\xff\xfe"}'
    surrogate = b'{"type":"command","run_id":"r1","command":"stop","reason":"\\udc80"}'
    nul = b'{"type":"command","run_id":"r1","command":"stop","reason":"a\\u0000b"}'
    lines = b"\n".join([good, not_utf8, surrogate, nul]) + b"\n"
    result = subprocess.run([*CLI, "publish", "--fill", "-"], env=stack_env, input=lines, capture_output=True,
                            timeout=180)
    assert result.returncode == 2, result.stderr
    assert result.stderr.decode().strip() == ("areal-metrics publish: error: line 2: event: not UTF-8 "
                                              "(invalid start byte at byte 59) (sent to the dead-letter topic)")
    got = [(m.topic, parse_event(m.value)) for m in read_to_end(kafka_bootstrap, topics.control, topics.deadletter)]
    (published,) = [e for t, e in got if t == topics.control]
    assert published.reason == "ok \u202e\U0001F600"  # a bidi control and a 4-byte character are text
    dead = sorted((e.raw, e.reason) for t, e in got if t == topics.deadletter)
    assert dead == sorted([
        ("base64:" + base64.b64encode(not_utf8).decode(), "event: not UTF-8 (invalid start byte at byte 59)"),
        (surrogate.decode(), "commands.reason: holds a lone surrogate U+DC80 (at index 0), which UTF-8 cannot encode"),
        (nul.decode(), "commands.reason: holds a NUL character (at index 1)"),
    ])
    assert json.loads(dead[-1][0])["command"] == "stop"
