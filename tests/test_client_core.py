"""The client's pure parts: value coercion, key aliases, launcher environments, attempts (no broker)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_metrics.producers.client import coerce
from areal_metrics.producers.client.aliases import ALIASES
from areal_metrics.producers.client.attempts import next_attempt, read_local, write_local
from areal_metrics.producers.contract.events import StepEvent, dumps_compact, event_from_dict
from areal_metrics.producers.contract.field_rules import SAMPLE_TEXT_MAX, SAMPLES_MAX
from areal_metrics.producers.client.launcher_env import identity_from_env, job_run_id
from areal_metrics.producers.client.run_info import clean_tags, detect_framework, git_commit, new_run_id
from areal_metrics.producers.contract.topics import Topics


class _FakeRun:
    """What `_Step.encode` reads of a Run."""

    run_id, node, rank, world_size, attempt, _epoch, _key = "r1", "h:0", 0, 2, 1, 0.0, b"r1"
    _sampler, _max_metrics = None, 1024

    def __init__(self) -> None:
        self.skipped: list[object] = []
        self.warned: dict[object, str] = {}

    def _note_skipped(self, names: tuple) -> None:
        self.skipped.extend(names)

    def _warn_once(self, key: object, message: str) -> None:
        self.warned[key] = message


def encoded_step(values: dict, step: int = 3) -> StepEvent:
    from areal_metrics.producers.client.run import _Step

    snap = coerce.snapshot(values)
    topic, key, raw = _Step(_FakeRun(), step, snap, 1.7e9).encode(Topics("t."))  # type: ignore[arg-type]
    assert (topic, key) == ("t.steps", b"r1")
    event = event_from_dict(json.loads(raw))
    assert isinstance(event, StepEvent)
    return event


def test_numbers_of_every_kind_become_python_numbers() -> None:
    values = {
        "a": np.float32(0.5), "b": np.int64(7), "c": torch.tensor(0.25), "d": torch.tensor([3.0]), "e": np.array(2.0),
        "f": True, "g": Decimal("1.5"), "h": Fraction(1, 4), "i": np.float64(0.1), "j": torch.tensor(1, dtype=torch.int32),
    }
    snap, skipped = coerce.numbers(coerce.snapshot(values))
    assert skipped == ()
    assert snap == {"a": 0.5, "b": 7, "c": 0.25, "d": 3.0, "e": 2.0, "f": 1, "g": 1.5, "h": 0.25, "i": 0.1, "j": 1}
    assert all(type(v) in (int, float) for v in snap.values())


def test_non_numbers_are_skipped_and_named_none_silently() -> None:
    snap, skipped = coerce.numbers(coerce.snapshot({"s": "0.5", "t": torch.ones(3), "l": [1.0], "n": None, "c": 1j,
                                                    "ok": 1.0, "z": torch.tensor(1j)}))
    assert snap == {"ok": 1.0}
    assert set(skipped) == {"s", "t", "l", "c", "z"}


def test_the_sender_names_the_values_it_skipped_to_the_run() -> None:
    from areal_metrics.producers.client.run import _Step

    run = _FakeRun()
    snap = coerce.snapshot({"note": "fine", "reward": np.float32(0.5), "t": torch.ones(2)})
    _, _, raw = _Step(run, 1, snap, 1.7e9).encode(Topics("t."))  # type: ignore[arg-type]
    assert run.skipped == ["note", "t"]
    assert json.loads(raw)["reward"] == 0.5


def test_a_tensor_is_read_when_logged_not_when_sent() -> None:
    t = torch.tensor(1.0)
    a = np.array(2.0)
    snap = coerce.snapshot({"loss": t, "acc": a, "n": np.float32(0.5)})
    t.add_(5.0)  # the training loop reuses the tensor after log() returned
    a += 1.0
    assert snap == {"loss": 1.0, "acc": 2.0, "n": 0.5}
    assert type(snap["loss"]) is float and type(snap["acc"]) is float


def test_nested_dicts_are_flattened_to_slash_names_and_read_when_logged() -> None:
    """W&B users log `{"train": {"loss": x}}`: each value goes in under `train/loss`, tensors read at `log`."""
    from collections import OrderedDict
    from types import MappingProxyType

    loss = torch.tensor(1.0)
    values = {"reward": 0.5, "train": {"loss": loss, "acc": np.float32(0.25), "more": {"x": 2, "note": "skip me"}},
              "eval": OrderedDict(score=np.array(3.0)), "frozen": MappingProxyType({"y": Decimal("1.5")}), "empty": {}}
    snap = coerce.snapshot(values)
    loss.add_(5.0)  # changed in place after log() returned: the logged value stays
    got, skipped = coerce.numbers(snap)
    assert got == {"reward": 0.5, "train/loss": 1.0, "train/acc": 0.25, "train/more/x": 2, "eval/score": 3.0,
                   "frozen/y": 1.5}
    assert skipped == ("train/more/note",)
    assert values["train"]["loss"] is loss and "train" in values  # the caller's dicts are not changed
    event = encoded_step(values)
    assert event.reward == 0.5 and event.metrics["train/loss"] == 6.0 and event.metrics["train/more/x"] == 2.0
    assert encoded_step({"critic": {"score": {"mean": 0.7}}}).reward == 0.7  # a framework's name, nested, is its alias
    for both in ({"a/b": 1.0, "a": {"b": 2.0}}, {"a": {"b": 2.0}, "a/b": 1.0}):  # a name given both ways: the nested
        assert coerce.numbers(coerce.snapshot(both))[0] == {"a/b": 2.0}


def test_dicts_deeper_than_the_limit_or_in_a_cycle_are_skipped_and_named() -> None:
    deep: dict = {"v": 1.0}
    for name in "dcba":
        deep = {name: deep}
    assert coerce.NESTED_MAX == 4
    got, skipped = coerce.numbers(coerce.snapshot({"ok": 1.0, **deep}))
    assert got == {"ok": 1.0} and skipped == ("a/b/c/d",)  # five levels: the fifth dict is not opened
    got, skipped = coerce.numbers(coerce.snapshot({"a": {"b": {"c": {"v": 1.0}}}}))
    assert got == {"a/b/c/v": 1.0} and skipped == ()  # four levels: flattened
    cycle: dict = {"x": 1.0}
    cycle["self"] = cycle
    got, skipped = coerce.numbers(coerce.snapshot({"c": cycle}))
    assert got == {"c/x": 1.0, "c/self/x": 1.0, "c/self/self/x": 1.0} and skipped == ("c/self/self/self",)

    class Unreadable(Mapping):  # a mapping that fails when read: kept as given, then skipped and named
        def __getitem__(self, key: object) -> float:
            raise KeyError(key)

        def __iter__(self):  # type: ignore[no-untyped-def]
            raise RuntimeError("no")

        def __len__(self) -> int:
            return 1

    got, skipped = coerce.numbers(coerce.snapshot({"u": Unreadable(), "ok": 1.0}))
    assert got == {"ok": 1.0} and skipped == ("u",)


def test_nan_and_inf_become_null_and_are_named() -> None:
    event = encoded_step({"reward": float("nan"), "kl": np.float32("inf"), "mine": -math.inf, "entropy": 1.0})
    assert event.reward is None and event.kl is None and event.entropy == 1.0
    assert set(event.non_finite) == {"reward", "kl", "mine"}
    assert "mine" not in event.metrics


def test_framework_aliases_fill_the_typed_columns() -> None:
    trl = encoded_step({"reward": 0.5, "reward_std": 0.1, "kl": 0.01, "entropy": 1.2, "clip_ratio/region_mean": 0.05,
                        "clip_ratio/low_mean": 0.01, "completions/mean_length": 40.0, "learning_rate": 1e-6,
                        "grad_norm": 0.7, "loss": 0.3, "step_time": 0.25, "epoch": 0.04})
    assert (trl.reward, trl.reward_std, trl.kl, trl.entropy, trl.clip_ratio) == (0.5, 0.1, 0.01, 1.2, 0.05)
    assert (trl.response_length, trl.lr, trl.grad_norm, trl.loss, trl.latency_ms) == (40.0, 1e-6, 0.7, 0.3, 250.0)
    assert trl.epoch == 0.04 and dict(trl.metrics) == {"clip_ratio/low_mean": 0.01}
    verl = encoded_step({"critic/score/mean": 0.4, "actor/entropy": 1.1, "actor/pg_clipfrac": 0.02, "actor/ppo_kl": 0.003,
                         "actor/lr": 1e-6, "response_length/mean": 100.0, "perf/throughput": 900.0,
                         "perf/total_num_tokens": 51200, "perf/max_memory_allocated_gb": 2.0, "timing_s/step": 3.0})
    assert (verl.reward, verl.entropy, verl.clip_ratio, verl.kl, verl.lr) == (0.4, 1.1, 0.02, 0.003, 1e-6)
    assert (verl.response_length, verl.throughput, verl.tokens, verl.gpu_mem_bytes, verl.latency_ms) == (
        100.0, 900.0, 51200, 2 << 30, 3000.0)
    areal = encoded_step({"ppo_actor/task_reward/avg": 0.6, "ppo_actor/update/actor_loss/avg": 0.2,
                          "ppo_actor/update/clip_ratio/avg": 0.1, "ppo_actor/update/approx_kl/avg": 0.01,
                          "ppo_actor/update/grad_norm": 1.5, "ppo_actor/update/lr": 2e-6,
                          "ppo_actor/update/grad_norm__count": 4})
    assert (areal.reward, areal.loss, areal.clip_ratio, areal.kl, areal.grad_norm, areal.lr) == (0.6, 0.2, 0.1, 0.01, 1.5, 2e-6)
    assert dict(areal.metrics) == {"ppo_actor/update/grad_norm__count": 4.0}


def test_a_scaled_alias_that_breaks_its_column_stays_a_metric_and_the_step_is_sent() -> None:
    """The columns' bounds are StepEvent's own: 1e99 s of `step_time` is beyond latency_ms's range
    (NUMBER_MAX) once in milliseconds, so it stays in `metrics` instead of failing the whole step."""
    event = encoded_step({"step_time": 1e99, "reward": 0.5})
    assert event.latency_ms is None and dict(event.metrics) == {"step_time": 1e99} and event.reward == 0.5


@pytest.mark.parametrize("column", sorted({column for column, _, _ in ALIASES.values()}))
def test_each_aliased_columns_bounds_are_what_step_event_accepts(column: str) -> None:
    from areal_metrics.producers.client.aliases import BOUNDS
    from areal_metrics.producers.contract.field_rules import ValidationError

    lo, hi = BOUNDS[column]
    for edge in (lo, hi):
        assert getattr(StepEvent(run_id="r", step=1, epoch=0, **{column: edge}), column) == edge
    for beyond in (lo - max(1.0, abs(lo)), hi + max(1.0, abs(hi))):
        with pytest.raises(ValidationError, match=f"steps.{column}"):
            StepEvent(run_id="r", step=1, epoch=0, **{column: type(lo)(beyond)})


def test_the_columns_own_name_wins_over_an_alias_whichever_comes_first() -> None:
    for values in ({"critic/score/mean": 0.1, "reward": 0.9}, {"reward": 0.9, "critic/score/mean": 0.1}):
        event = encoded_step(values)
        assert event.reward == 0.9 and dict(event.metrics) == {"critic/score/mean": 0.1}


def test_an_alias_never_fills_a_column_whose_own_name_was_nan() -> None:
    for values in ({"reward": float("nan"), "critic/score/mean": 0.5}, {"critic/score/mean": 0.5, "reward": float("nan")}):
        event = encoded_step(values)
        assert event.reward is None and list(event.non_finite) == ["reward"]
        assert dict(event.metrics) == {"critic/score/mean": 0.5}


def test_a_hair_outside_a_rule_is_clamped_far_outside_moves_to_metrics() -> None:
    event = encoded_step({"clip_ratio": 1.0000001, "lr": -1e-12, "grad_norm": -0.5, "tokens": 4096.4, "epoch": -1})
    assert event.clip_ratio == 1.0 and event.lr == 0.0 and event.tokens == 4096
    assert event.grad_norm is None and dict(event.metrics) == {"grad_norm": -0.5, "epoch": -1.0}
    assert encoded_step({"clip_ratio": 1.5}).metrics == {"clip_ratio": 1.5}


def test_long_and_odd_names() -> None:
    event = encoded_step({"x" * 300: 1.0, "": 2.0, 7: 3.0, ("a", 1): 4.0})
    assert dict(event.metrics) == {"x" * 256: 1.0, "7": 3.0, "('a', 1)": 4.0}


def test_epoch_is_kept_fractional_and_carried_over() -> None:
    parts = coerce.split_step({"epoch": 0.375, "reward": 1.0})
    assert parts.epoch == 0.375
    assert coerce.split_step({"reward": 1.0}, previous_epoch=0.375).epoch == 0.375
    nan = coerce.split_step({"epoch": float("nan")}, previous_epoch=2.5)
    assert nan.epoch == 2.5 and nan.non_finite == ["epoch"]


_weird = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5),
    st.decimals(allow_nan=False), st.fractions(), st.binary(max_size=3), st.lists(st.floats(), max_size=2),
    st.floats(width=32).map(np.float32), st.integers(-(2**63), 2**63 - 1).map(np.int64),
    st.floats(width=32).map(lambda x: torch.tensor(x)), st.complex_numbers(),
)
_names = st.one_of(st.sampled_from(sorted(ALIASES)), st.text(max_size=300), st.integers(), st.just("epoch"))


# values as logged, dicts of them in dicts included (flattened to `a/b` names, down to coerce.NESTED_MAX levels)
_nested = st.recursive(_weird, lambda inner: st.dictionaries(_names, inner, max_size=3), max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_names, _nested, max_size=30), st.integers(0, 2**40))
def test_any_values_give_a_valid_step_event(values: dict, step: int) -> None:
    """log() never raises for a value: whatever is logged, the client sends a record every reader accepts."""
    event = encoded_step(values, step)
    assert event.step == step and event.attempt == 1 and event.world_size == 2


# ----------------------------------------------------------------- evaluations


def test_verdicts_and_samples_are_coerced_and_capped() -> None:
    assert coerce.verdicts([True, 0, 1.0, 0.2, -1, float("nan"), "x"]) == [1, 0, 1, 1, 0, 0, 0]
    assert coerce.verdicts(np.array([1, 0, 1])) == [1, 0, 1] and coerce.verdicts(torch.tensor([0, 1])) == [0, 1]
    records, cut = coerce.samples([{"prompt": "p" * (SAMPLE_TEXT_MAX + 10), "response": 5, "verdict": True,
                                    "reward": float("nan"), "extra": 1}] * (SAMPLES_MAX + 3))
    assert len(records) == SAMPLES_MAX and cut == 3
    assert records[0] == {"prompt": "p" * SAMPLE_TEXT_MAX, "response": "5", "verdict": 1}


def test_eval_fields_compute_accuracy_and_refuse_nothing() -> None:
    from areal_metrics.producers.client.run import _eval_fields

    f = _eval_fields([1, 0, 1, 1], None, None, "ok", None, np.float32(12.0), None, None, {"pass@4": 0.9, "bad": "x"})
    assert f["accuracy"] == 0.75 and f["n_samples"] == 4 and f["response_length"] == 12.0
    assert f["metrics"] == {"pass@4": 0.9}
    pct = _eval_fields(None, 85.0, None, "ok", None, None, None, None, {})
    assert pct["status"] == "failed" and pct["metrics"] == {"accuracy": 85.0} and "accuracy" not in pct
    assert _eval_fields(None, 1.0000001, None, "ok", None, None, None, None, {})["accuracy"] == 1.0


# ------------------------------------------------------------ environment


@pytest.mark.parametrize("env, want", [
    ({}, (0, 1, None, None)),
    ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3"}, (3, 8, 3, "torchrun")),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1"}, (5, 16, 1, "slurm")),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}, (2, 4, 0, "openmpi")),
    ({"PMI_RANK": "1", "PMI_SIZE": "2"}, (1, 2, None, "pmi")),
    # torchrun under srun: RANK names the process
    ({"RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, (9, 16, 1, "torchrun")),
    ({"RANK": "x", "WORLD_SIZE": "2", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, (1, 2, None, "slurm")),
    ({"RANK": "4", "WORLD_SIZE": "2"}, (0, 1, None, None)),
])
def test_identity_from_the_launchers(env: dict, want: tuple) -> None:
    ident = identity_from_env(env, "gpu7")
    assert (ident.rank, ident.world_size, ident.local_rank, ident.launcher) == want


def test_eight_ranks_on_one_host_are_eight_nodes() -> None:
    nodes = {identity_from_env({"RANK": str(r), "WORLD_SIZE": "8", "LOCAL_RANK": str(r)}, "h").node for r in range(8)}
    assert len(nodes) == 8 and "h:0" in nodes
    assert len(identity_from_env({}, "x" * 300).node) == 128


def test_job_run_ids_every_rank_shares() -> None:
    assert job_run_id({"AREAL_RUN_ID": "mine", "SLURM_JOB_ID": "1"}) == "mine"
    assert job_run_id({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0"}) == "slurm-77.0"
    assert job_run_id({"TORCHELASTIC_RUN_ID": "abc-1"}) == "torchrun-abc-1"
    assert job_run_id({}) is None
    assert new_run_id(0).startswith("run-19700101-000000-")


def test_tags_framework_and_git_never_raise(tmp_path) -> None:
    assert clean_tags(["a", "a", 3, "", "b" * 300]) == ("a", "3", "b" * 256)
    with pytest.raises(TypeError):
        clean_tags("grpo")
    assert detect_framework({"torch": 1, "trl": 1}) == "trl" and detect_framework({}) == "python"
    assert git_commit(tmp_path) is None  # not a repository
    assert git_commit(tmp_path / "missing") is None


def test_next_attempt_and_the_local_record(tmp_path) -> None:
    assert next_attempt(None, None, None) == 0
    assert next_attempt(2, None, 5) == 3  # own history first: never the attempt peers just announced
    assert next_attempt(None, 4, 4) == 5 and next_attempt(1, 3, None) == 4
    assert next_attempt(None, None, 2) == 2  # a new rank joins the run's latest attempt
    path = tmp_path / "r" / "rank-0.json"
    assert read_local(path) is None
    write_local(path, 3)
    assert read_local(path) == 3
    path.write_text("garbage")
    assert read_local(path) is None


# ------------------------------------------------------------ the step record's JSON codec

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)


@given(st.dictionaries(st.text(max_size=12), _json_values, max_size=8))
def test_the_compact_encoder_writes_what_json_writes_or_fails_as_json_fails(data):
    try:
        expected = json.dumps(data, allow_nan=False, separators=(",", ":"))
    except ValueError:
        with pytest.raises(ValueError):
            dumps_compact(data)
        return
    assert json.loads(dumps_compact(data)) == json.loads(expected)


def test_the_compact_encoder_keeps_integers_beyond_64_bits_and_refuses_nan():
    assert dumps_compact({"tokens": 2**70, "m": {"a": 0.5}}) == b'{"tokens":1180591620717411303424,"m":{"a":0.5}}'
    with pytest.raises(ValueError):
        dumps_compact({"metrics": {"loss": float("nan")}})


def test_a_free_form_name_gives_a_valid_stable_run_id_and_is_kept() -> None:
    from areal_metrics.producers.client.run_info import clean_name, run_id_for
    from areal_metrics.producers.contract.ids import is_valid_run_id

    assert run_id_for("exp-1") == "exp-1"  # a valid id stays itself
    derived = run_id_for("proj/exp lr=1e-6")
    assert derived.startswith("proj-exp-lr-1e-6-") and is_valid_run_id(derived) and derived == run_id_for("proj/exp lr=1e-6")
    assert run_id_for("proj/exp lr=1e-5") != derived  # the hash keeps names that slug alike apart
    assert clean_name(" 实验 α ") == "实验 α" and clean_name("") is None and len(clean_name("x" * 300)) == 256


@given(st.text(min_size=1, max_size=400))
def test_any_name_gives_a_valid_run_id(name: str) -> None:
    from areal_metrics.producers.client.run_info import clean_name, run_id_for
    from areal_metrics.producers.contract.ids import is_valid_run_id

    assert is_valid_run_id(run_id_for(name))
    kept = clean_name(name)
    assert kept is None or (len(kept) <= 256 and kept.encode("utf-8"))


def test_a_client_that_cannot_deliver_says_so_once_naming_the_bootstrap_and_the_journal(tmp_path, capsys) -> None:
    from areal_metrics.producers.client.run import init
    from areal_metrics.stack.kafka_broker import free_port

    dead = f"127.0.0.1:{free_port()}"
    run = init(run_id="nowhere", kafka_bootstrap=dead, journal_dir=str(tmp_path / "j"), git=False, rank=0,
               world_size=1, exit_timeout_s=2.0)
    for step in range(5):
        run.log({"reward": 0.1 * step}, step=step)
    run.finish()
    told = [line for line in capsys.readouterr().err.splitlines() if "cannot deliver" in line]
    assert len(told) == 1 and dead in told[0] and str(tmp_path / "j") in told[0], told
    assert "init(kafka_bootstrap=...)" in told[0] and "areal-metrics sync" in told[0]
    assert run.stats().journaled == 7  # running, 5 steps, finished: all kept


def test_the_home_is_per_user_and_the_broker_the_one_up_recorded(tmp_path, monkeypatch) -> None:
    import json as _json
    from pathlib import Path

    from areal_metrics.producers.contract.settings import DEFAULT_BOOTSTRAP, Settings, bootstrap_origin, state_dir

    monkeypatch.delenv("AREAL_HOME", raising=False)
    monkeypatch.delenv("AREAL_KAFKA_BOOTSTRAP", raising=False)
    monkeypatch.delenv("AREAL_TOPIC_PREFIX", raising=False)
    monkeypatch.delenv("AREAL_CLICKHOUSE_URL", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "me"))
    monkeypatch.chdir(tmp_path)
    assert state_dir() == tmp_path / "me" / ".areal"  # not the working directory's
    assert Settings.from_env().kafka_bootstrap == DEFAULT_BOOTSTRAP and "the default" in bootstrap_origin()
    home = tmp_path / "team"
    home.mkdir()
    (home / "stack.json").write_text(_json.dumps({"kafka_bootstrap": "127.0.0.1:41231", "topic_prefix": "t.",
                                                  "clickhouse_url": "chdb:///srv/store"}))
    monkeypatch.setenv("AREAL_HOME", "team")  # relative: made absolute once, at the call
    assert state_dir() == home and Path(state_dir()).is_absolute()
    found = Settings.from_env()
    assert (found.kafka_bootstrap, found.topic_prefix, found.clickhouse_url) == ("127.0.0.1:41231", "t.", "chdb:///srv/store")
    assert str(home / "stack.json") in bootstrap_origin()
    # the folder init(home=...) read, not AREAL_HOME's (the warning named the wrong one)
    other = tmp_path / "other"
    assert bootstrap_origin(other) == f"the default (no AREAL_KAFKA_BOOTSTRAP, no stack recorded in {other / 'stack.json'})"
    monkeypatch.setenv("AREAL_KAFKA_BOOTSTRAP", "kafka:9092")  # the environment wins
    assert Settings.from_env().kafka_bootstrap == "kafka:9092" and bootstrap_origin() == "AREAL_KAFKA_BOOTSTRAP"


_VALUE_MAKERS = [
    lambda x: x, lambda x: int(x), lambda x: bool(x), lambda x: None, lambda x: str(x),
    lambda x: __import__("numpy").float32(x), lambda x: __import__("numpy").int64(int(x)),
    lambda x: __import__("numpy").bool_(x > 0), lambda x: __import__("numpy").complex64(x),
    lambda x: __import__("numpy").array(x), lambda x: __import__("numpy").array([x, x]),
    lambda x: __import__("torch").tensor(x), lambda x: __import__("torch").tensor(int(x)),
    lambda x: __import__("torch").tensor([x, x]), lambda x: __import__("decimal").Decimal(str(x)),
]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(_VALUE_MAKERS) - 1),
                          st.one_of(st.floats(-1e6, 1e6), st.just(float("nan")))), max_size=30))
def test_a_snapshot_reads_each_value_as_to_number_does_whatever_the_mix_of_types(picks) -> None:
    """snapshot (tensors and arrays read on the caller's thread) then numbers (the rest, values of one
    type together): the same numbers as reading each alone, the same names skipped, in the caller's order."""
    values = {}
    for i, (maker, x) in enumerate(picks):
        try:
            values[f"m{i}"] = _VALUE_MAKERS[maker](x)
        except (ValueError, OverflowError):  # int(nan)
            values[f"m{i}"] = None
    snap = coerce.snapshot(values)
    assert all(type(v) not in (torch.Tensor, np.ndarray) or v is values[k] for k, v in snap.items())  # read, or kept when not one number
    got, skipped = coerce.numbers(snap)
    alone = {k: coerce.to_number(v) for k, v in values.items()}
    expected = {k: x for k, x in alone.items() if x is not None}
    assert list(got) == list(expected)
    assert all(type(got[k]) is type(expected[k]) and (got[k] == expected[k] or got[k] != got[k]) for k in got)
    assert skipped == tuple(k for k, x in alone.items() if x is None and values[k] is not None)
