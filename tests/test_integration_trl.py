"""TRL's GRPOTrainer with `ArealMetricsCallback`, against the real broker, stream worker and sink.

The model and tokenizer are built here (a GPT-2 of two tiny layers over a
character vocabulary, randomly initialised): nothing is downloaded. A Python
reward function rewards completions that contain a digit, so `eval_reward` is
an accuracy.

- A few GRPO steps with an evaluation every 2 steps: every step is a row in
  ClickHouse with TRL's values in the typed columns (reward, lr, latency from
  step_time...), the fractional epoch, the rest in `metrics`; each evaluation
  is an eval result with its consensus; the run is `finished`.
- `evaluate_now` and `stop` published on the control topic: the trainer
  evaluates once more and stops long before its max_steps; under torchrun
  with 2 processes (only rank 0 has a run), both ranks evaluate and stop at
  the same step.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

from areal_metrics.producers.contract.events import CommandEvent, parse_event
from areal_metrics.producers.contract.topics import Topics
from tests import integration_support, test_client_broker
from tests.integration_support import publish_commands, rows_when, torchrun_obeying
from tests.kafka_reading import read_to_end
from tests.support import wait_for

sink = test_client_broker.sink  # the fixture: the real sink as a process, queried through its endpoint
stream_worker = integration_support.stream_worker  # the fixture: the real stream worker as a process

pytestmark = [pytest.mark.broker, pytest.mark.timeout(600)]

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789+= "


def reward_has_digit(completions: list[str], **kwargs: Any) -> list[float]:
    return [1.0 if any(c.isdigit() for c in text) else 0.0 for text in completions]


def tiny_grpo_trainer(out: Path, callback: Any, **config: Any) -> Any:
    """GRPOTrainer on a randomly initialised 2-layer GPT-2 and a character tokenizer, on CPU, offline."""
    import torch
    from datasets import Dataset
    from huggingface_hub import constants as hub
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    assert hub.HF_HUB_OFFLINE, "huggingface_hub was imported before the offline switch"
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # one token per character
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                                        unk_token="<unk>")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(vocab), n_positions=32, n_embd=16, n_layer=2, n_head=2,
                                       bos_token_id=1, eos_token_id=1, pad_token_id=0))
    prompts = Dataset.from_list([{"prompt": f"{i}+{i}="} for i in range(32)])
    settings = dict(output_dir=str(out), use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
                    per_device_train_batch_size=4, num_generations=2, max_completion_length=4, logging_steps=1,
                    eval_strategy="steps", per_device_eval_batch_size=4, seed=0)
    args = GRPOConfig(**{**settings, **config})
    return GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=reward_has_digit, args=args,
                       train_dataset=prompts, eval_dataset=prompts.select(range(4)), callbacks=[callback])


@pytest.fixture
def areal_env(stack_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """This process talks to the test broker as a trainer would: through the AREAL_* environment."""
    for name, value in stack_env.items():
        if name.startswith("AREAL_"):
            monkeypatch.setenv(name, value)
    monkeypatch.setenv("AREAL_EXIT_TIMEOUT_S", "30")
    return stack_env


def test_grpo_steps_and_evaluations_reach_clickhouse(areal_env: dict[str, str], topics: Topics, tmp_path: Path,
                                                     sink, stream_worker) -> None:
    from areal_metrics.integrations.trl import ArealMetricsCallback

    callback = ArealMetricsCallback(run_id="trl-grpo", tags=["trl", "test"], group="integrations",
                                    accuracy_key="eval_reward", git=False)
    trainer = tiny_grpo_trainer(tmp_path / "out", callback, max_steps=4, eval_steps=2, log_completions=True,
                                num_completions_to_print=0)
    callback.attach(trainer)  # already among its callbacks: only lets it read the completions TRL logs
    trainer.train()
    assert callback.run.stats().failed == 0
    logged = {e["step"]: e for e in trainer.state.log_history if "reward" in e}
    evaluated = {e["step"]: e for e in trainer.state.log_history if "eval_reward" in e}
    assert sorted(logged) == [1, 2, 3, 4] and sorted(evaluated) == [2, 4]

    wait_for(lambda: sink("SELECT count() FROM v_steps WHERE run_id = 'trl-grpo'") == [(4,)], 120, "4 step rows")
    # HF's train summary is logged at step 4 again: a second event for that row, the union of both
    wait_for(lambda: sink("SELECT step FROM v_steps WHERE run_id = 'trl-grpo' "
                          "AND mapContains(metrics, 'train_runtime')") == [(4,)], 120, "the summary on step 4")
    rows = sink("SELECT step, epoch, reward, reward_std, entropy, lr, loss, latency_ms, response_length, "
                "clip_ratio, metrics, rank, world_size FROM v_steps WHERE run_id = 'trl-grpo' ORDER BY step")
    for step, epoch, reward, reward_std, entropy, lr, loss, latency_ms, length, clip, metrics, rank, world in rows:
        trl_log = logged[step]
        assert (rank, world) == (0, 1)
        assert epoch == pytest.approx(trl_log["epoch"]) and 0 < epoch < 1  # fractional, as HF counts it
        assert reward == pytest.approx(trl_log["reward"]) and reward_std == pytest.approx(trl_log["reward_std"])
        assert entropy == pytest.approx(trl_log["entropy"]) and lr == pytest.approx(trl_log["learning_rate"])
        assert loss == pytest.approx(trl_log["loss"]) and latency_ms == pytest.approx(trl_log["step_time"] * 1000)
        assert length == pytest.approx(trl_log["completions/mean_length"])
        assert clip == pytest.approx(trl_log["clip_ratio/region_mean"])
        assert metrics["rewards/reward_has_digit/mean"] == pytest.approx(trl_log["rewards/reward_has_digit/mean"])
        assert "clip_ratio/low_mean" in metrics and "num_tokens" in metrics
        assert not any(name.startswith("eval_") for name in metrics)  # evaluations are eval results
    # TRL's cumulative num_tokens -> tokens per step and tokens/s: the throughput panels have data
    tokens = sink("SELECT step, tokens, throughput FROM v_steps WHERE run_id = 'trl-grpo' ORDER BY step")
    seen = [0.0] + [logged[s]["num_tokens"] for s in sorted(logged)]
    assert [t for _, t, _ in tokens] == [round(b - a) for a, b in zip(seen, seen[1:])]
    assert all(t > 0 and tp > 0 for _, t, tp in tokens)
    summary = next(e for e in trainer.state.log_history if "train_runtime" in e)  # HF's last log, at step 4
    assert rows[-1][10]["train_runtime"] == pytest.approx(summary["train_runtime"])  # joins the last row
    assert all("train_runtime" not in row[10] for row in rows[:-1])

    evals = rows_when(sink, "SELECT step, dataset, accuracy, reward, replicas, status, metrics FROM v_evals "
                            "WHERE run_id = 'trl-grpo' ORDER BY step", 2, "the eval results")
    assert [(s, d, r, st) for s, d, _, _, r, st, _ in evals] == [(2, "eval", 1, "ok"), (4, "eval", 1, "ok")]
    for step, _, accuracy, reward, _, _, metrics in evals:
        assert accuracy == pytest.approx(evaluated[step]["eval_reward"]) and reward == pytest.approx(accuracy)
        assert metrics["rewards/reward_has_digit/mean"] == pytest.approx(accuracy)
    consensus = rows_when(sink, "SELECT step, votes FROM v_eval_consensus WHERE run_id = 'trl-grpo' ORDER BY step",
                          2, "the consensus of each evaluation")
    assert consensus == [(2, 1), (4, 1)]
    runs = wait_for(lambda: sink("SELECT status, framework, tags, `group`, config FROM v_runs "
                                 "WHERE run_id = 'trl-grpo' AND status != 'running'"), 60, "the run to finish")
    status, framework, tags, group, config = runs[0]
    assert (status, framework, tags, group) == ("finished", "trl", ["trl", "test"], "integrations")
    assert json.loads(config)["max_steps"] == 4  # the training arguments are the run's config
    assert json.loads(config)["eval_interval_steps"] == 2  # the user's eval_steps: the worker's base interval
    # the evaluations' completions (TRL's log_completions) are the eval results' samples: rows of `generations`
    generations = rows_when(sink, "SELECT step, prompt, response FROM generations FINAL WHERE run_id = 'trl-grpo' "
                                  "ORDER BY step", 2, "the evaluations' completions")
    assert {s for s, _, _ in generations} == {2, 4} and all("+" in p for _, p, _ in generations)
    commands = [parse_event(r.value) for r in read_to_end(areal_env["AREAL_KAFKA_BOOTSTRAP"], topics.control)]
    assert not [c for c in commands if c.run_id == "trl-grpo" and c.command == "set_eval_interval"]
    assert stream_worker.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]  # faust runs beside TRL's click


def test_evaluate_now_and_stop_on_the_control_topic_are_obeyed(areal_env: dict[str, str], topics: Topics,
                                                               tmp_path: Path, sink) -> None:
    import areal_metrics as am
    from areal_metrics.integrations.trl import ArealMetricsCallback

    run = am.init(run_id="trl-stop", world_size=1, git=False)  # a run of the test's own: the callback leaves it open
    publish_commands(areal_env["AREAL_KAFKA_BOOTSTRAP"], topics, "trl-stop", ("evaluate_now", "stop"))  # after init

    trainer = tiny_grpo_trainer(tmp_path / "out", ArealMetricsCallback(run, accuracy_key="eval_reward"),
                                max_steps=400, eval_steps=1000)  # never a scheduled evaluation before max_steps
    trainer.train()
    stopped_at = trainer.state.global_step
    assert stopped_at < 400
    evaluated = [e["step"] for e in trainer.state.log_history if "eval_reward" in e]
    assert len(evaluated) == 1 and evaluated[0] <= stopped_at  # the command's evaluation; none was scheduled
    run.finish()

    wait_for(lambda: sink("SELECT count() FROM v_steps WHERE run_id = 'trl-stop'") == [(stopped_at,)], 120,
             "the steps before the stop")
    assert rows_when(sink, "SELECT step, status FROM v_evals WHERE run_id = 'trl-stop'", 1, "the eval result") == [
        (evaluated[0], "ok")]


class WeightProbe:
    """Records the weights right after update `step` (before any callback's step end) and at the next step's
    begin (after every step end), as tensors."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.after_update: dict[str, Any] = {}
        self.next_begin: dict[str, Any] = {}

    def callback(self) -> Any:
        from transformers import TrainerCallback

        probe = self

        class Probe(TrainerCallback):
            def on_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
                if state.global_step + 1 == probe.step:  # global_step grows after the optimizer step
                    probe.after_update = {k: v.detach().clone() for k, v in model.state_dict().items()}

            def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
                if state.global_step == probe.step:
                    probe.next_begin = {k: v.detach().clone() for k, v in model.state_dict().items()}

        return Probe()


def test_scale_lr_with_a_rollback_reaches_grpo_from_its_step(areal_env: dict[str, str], topics: Topics,
                                                              tmp_path: Path, sink) -> None:
    """`scale_lr` {factor 0.5, from_step 6, restore_step 5} published on the control topic while GRPO trains
    with a linear schedule and save_steps=2: the lr TRL logs is the same schedule's (a run without the command)
    before step 6 and exactly half of it from step 6 on; the weights before update 6 are checkpoint-4's, and
    they are evaluated at once."""
    from safetensors.torch import load_file
    from transformers import TrainerCallback

    import areal_metrics as am
    from areal_metrics.integrations.trl import ArealMetricsCallback

    schedule = dict(max_steps=10, eval_steps=1000, lr_scheduler_type="linear", warmup_steps=2, learning_rate=1e-3,
                    save_strategy="steps", save_steps=2)
    base = tiny_grpo_trainer(tmp_path / "base", TrainerCallback(), **schedule)
    base.train()
    base_lr = {e["step"]: e["learning_rate"] for e in base.state.log_history if "learning_rate" in e}
    assert sorted(base_lr) == list(range(1, 11)) and len(set(base_lr.values())) > 5  # a schedule that moves

    run = am.init(run_id="trl-lr", world_size=1, git=False)
    assert run.commands() == []  # starts the control feed, from the run's start
    command = CommandEvent(run_id="trl-lr", node="worker", command="scale_lr", reason="test",
                           args={"factor": 0.5, "from_step": 6, "restore_step": 5})
    publish_events(areal_env["AREAL_KAFKA_BOOTSTRAP"], topics.control, [command])
    wait_for(lambda: run._feed is not None and run._feed._pending, 60, "the command in the run's feed")  # undrained

    probe = WeightProbe(5)
    callback = ArealMetricsCallback(run, accuracy_key="eval_reward")
    trainer = tiny_grpo_trainer(tmp_path / "out", callback, **schedule)
    trainer.add_callback(probe.callback())  # after ours: sees the weights our step end left
    trainer.train()
    lr = {e["step"]: e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e}
    assert sorted(lr) == sorted(base_lr)
    for step in sorted(lr):
        assert lr[step] == pytest.approx((0.5 if step >= 6 else 1.0) * base_lr[step], rel=1e-12, abs=0), step
    assert callback.applier is not None and callback.applier.factor == 0.5

    saved = load_file(str(tmp_path / "out" / "checkpoint-4" / "model.safetensors"))  # the newest <= step 5
    assert saved and probe.after_update and probe.next_begin
    assert any(not torch_equal(probe.after_update[k], v) for k, v in saved.items())  # update 5 moved them
    for name, value in saved.items():
        assert torch_equal(probe.next_begin[name], value), name  # and the rollback put checkpoint-4's back
    # the weights put back are evaluated at once, before update 6 (eval_steps 1000: no other round)
    evaluated = [e["step"] for e in trainer.state.log_history if "eval_reward" in e]
    assert evaluated[:1] == [5] and not [e for e in base.state.log_history if "eval_reward" in e and e["step"] == 5]
    run.finish()


def test_a_resumed_grpo_neither_applies_a_command_again_nor_forgets_one_waiting(
        areal_env: dict[str, str], topics: Topics, tmp_path: Path, sink) -> None:
    """Two scale_lr (x0.5 from step 3, applied; x0.5 from step 9, waiting at the checkpoint of step 6); the
    training resumed from checkpoint-6 with a new run that receives the first command again (same event id):
    its lrs at steps 7-10 are the uninterrupted training's (x0.5 until 8, x0.25 from 9)."""
    import areal_metrics as am
    from areal_metrics.integrations.trl import COMMANDS_FILE, ArealMetricsCallback

    schedule = dict(max_steps=10, eval_steps=1000, lr_scheduler_type="linear", warmup_steps=2, learning_rate=1e-3,
                    save_strategy="steps", save_steps=2)
    first = CommandEvent(run_id="trl-resume", node="worker", command="scale_lr", args={"factor": 0.5, "from_step": 3})
    second = CommandEvent(run_id="trl-resume", node="worker", command="scale_lr", args={"factor": 0.5, "from_step": 9})

    def run_with(commands: list[CommandEvent]) -> Any:
        run = am.init(run_id="trl-resume", world_size=1, git=False)
        assert run.commands() == []
        publish_events(areal_env["AREAL_KAFKA_BOOTSTRAP"], topics.control, commands)
        wait_for(lambda: run._feed is not None and len(run._feed._pending) == len(commands), 60, "the commands")
        return run

    run = run_with([first, second])
    whole = tiny_grpo_trainer(tmp_path / "out", ArealMetricsCallback(run, accuracy_key="eval_reward"), **schedule)
    whole.train()
    run.finish()
    lr = {e["step"]: e["learning_rate"] for e in whole.state.log_history if "learning_rate" in e}
    saved = json.loads((tmp_path / "out" / "checkpoint-6" / COMMANDS_FILE).read_text())
    assert saved["factor"] == 0.5 and saved["applied"] == [first.event_id]
    assert [c["event_id"] for c in saved["waiting"]] == [second.event_id]

    run = run_with([first])  # the first again: a feed that reads it twice must not apply it twice
    callback = ArealMetricsCallback(run, accuracy_key="eval_reward")
    resumed = tiny_grpo_trainer(tmp_path / "out", callback, **schedule)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-6"))
    run.finish()
    again = {e["step"]: e["learning_rate"] for e in resumed.state.log_history if "learning_rate" in e and e["step"] > 6}
    assert sorted(again) == [7, 8, 9, 10]
    for step in again:
        assert again[step] == pytest.approx(lr[step], rel=1e-12, abs=0), step
    # linear decay: update s uses (10 - (s - 1)) / 8 of 1e-3: 3/8 at 8, 2/8 at 9; times 0.5 at 8, 0.25 at 9
    assert (lr[8], lr[9]) == (pytest.approx(1e-3 * 3 / 8 * 0.5, rel=1e-9), pytest.approx(1e-3 * 2 / 8 * 0.25, rel=1e-9))
    assert callback.applier is not None and callback.applier.factor == 0.25


def torch_equal(a: Any, b: Any) -> bool:
    import torch

    return bool(torch.equal(a, b))


def publish_events(bootstrap: str, topic: str, events: list[Any]) -> None:
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    for event in events:
        producer.send(topic, key=event.run_id.encode(), value=event.to_json())
    producer.flush(30)
    producer.close()


DDP_SCRIPT = """
    import os, sys
    from pathlib import Path
    import areal_metrics as am
    from areal_metrics.integrations.trl import ArealMetricsCallback
    from tests.test_integration_trl import tiny_grpo_trainer

    rank = int(os.environ["RANK"])
    run = am.init(run_id="trl-ddp", world_size=1, git=False) if rank == 0 else None  # only rank 0 logs
    if rank == 0:
        print("ready", flush=True)
    callback = ArealMetricsCallback(run, accuracy_key="eval_reward")
    trainer = tiny_grpo_trainer(Path(sys.argv[1]) / f"rank{rank}", callback, max_steps=400, eval_steps=1000)
    trainer.train()
    if run is not None:
        run.finish()  # a run of your own: you finish it (the callback leaves it open)
    evaluated = [e["step"] for e in trainer.state.log_history if "eval_reward" in e]
    # a file per rank, not stdout: HF's PrinterCallback prints rank 0's logs unflushed, and a block of them
    # can end mid-line in the shared pipe, right before rank 1's line
    ending = " ".join(str(word) for word in ("stopped", trainer.state.global_step, "evaluated", *evaluated))
    (Path(sys.argv[1]) / f"rank{rank}.end").write_text(ending)
"""


def test_two_processes_evaluate_and_stop_at_the_same_step(stack_env: dict[str, str], topics: Topics, tmp_path: Path,
                                                          sink) -> None:
    script = tmp_path / "ddp_grpo.py"
    script.write_text(textwrap.dedent(DDP_SCRIPT))
    torchrun_obeying([str(script), str(tmp_path)], stack_env, topics, "trl-ddp", ["ready"],
                     tmp_path / "torchrun.log", timeout=500)
    ends = [(tmp_path / f"rank{rank}.end").read_text().split() for rank in (0, 1)]
    assert ends[0] == ends[1] and ends[0][0] == "stopped"  # rank 0's decision, on both ranks
    stopped_at, evaluated = int(ends[0][1]), [int(s) for s in ends[0][3:]]
    assert stopped_at < 400 and len(evaluated) == 1 and evaluated[0] <= stopped_at

    wait_for(lambda: sink("SELECT count() FROM v_steps WHERE run_id = 'trl-ddp'") == [(stopped_at,)], 120,
             "rank 0's steps")
    assert sink("SELECT DISTINCT rank, world_size FROM v_steps WHERE run_id = 'trl-ddp'") == [(0, 1)]
    assert rows_when(sink, "SELECT step FROM v_evals WHERE run_id = 'trl-ddp'", 1, "the eval result") == [
        (evaluated[0],)]
    assert rows_when(sink, "SELECT status FROM v_runs WHERE run_id = 'trl-ddp' AND status != 'running'", 1,
                     "the run to finish") == [("finished",)]
