"""The evaluation details of the report: pass@K, maj@K and greedy accuracy per round (figure 1 on
request), the wrong answers by error type per round (the error figure's trend), and the "what changed" table (prompts whose verdict flipped between a run's first and
last round).

Loaders take an open store (areal_metrics.sinks.query) and a SQL filter on run_id; nothing here
draws. A prompt's verdict in a round is the majority of the verdicts the nodes stored for it in
`generations` (the first sample of each shown prompt, full stage); a tie leaves it undecided, and an
undecided round is no flip.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHANGES_FILE = "what_changed.md"
RESPONSE_SHOWN = 60  # characters of a response in the table


def load_consensus_metrics(store: Any, where: str) -> dict[str, dict[str, list[tuple[int, dict[str, float]]]]]:
    """dataset -> run -> (step, {pass@K, maj@K, greedy_accuracy}) of each full-stage consensus, by step."""
    rows = store.query(f"""
        SELECT dataset, run_id, step, argMax(metrics, ts)
        FROM v_eval_consensus
        WHERE {where} AND stage = 'full' AND NOT stale
        GROUP BY dataset, run_id, step
        ORDER BY dataset, run_id, step""").rows
    out: dict[str, dict[str, list[tuple[int, dict[str, float]]]]] = defaultdict(lambda: defaultdict(list))
    for dataset, run, step, metrics in rows:
        if metrics:
            out[dataset][run].append((int(step), {str(k): float(v) for k, v in dict(metrics).items()}))
    return out


def load_errors_by_round(store: Any, where: str) -> dict[str, dict[int, dict[str, float]]]:
    """dataset -> step -> error type -> wrong answers of the full stages at that step (over runs and nodes)."""
    out: dict[str, dict[int, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    for dataset, step, key, count in store.query(f"""
            SELECT dataset, step, key, sum(metrics[key])
            FROM v_evals ARRAY JOIN mapKeys(metrics) AS key
            WHERE {where} AND status = 'ok' AND stage = 'full' AND startsWith(key, 'errors.')
            GROUP BY dataset, step, key ORDER BY dataset, step, key""").rows:
        out[dataset][int(step)][key.removeprefix("errors.")] = float(count)
    return out


def load_runs_by_round(store: Any, where: str) -> dict[str, dict[int, int]]:
    """dataset -> step -> how many runs evaluated a full stage at that step (what each round of the trend pools)."""
    out: dict[str, dict[int, int]] = defaultdict(dict)
    for dataset, step, runs in store.query(f"""
            SELECT dataset, step, uniqExact(run_id) FROM v_evals
            WHERE {where} AND status = 'ok' AND stage = 'full'
            GROUP BY dataset, step""").rows:
        out[dataset][int(step)] = int(runs)
    return out


@dataclass(frozen=True)
class Flip:
    run: str
    dataset: str
    prompt: str
    gold: str
    first_step: int
    first_verdict: int
    first_error: str
    last_step: int
    last_verdict: int
    last_error: str
    last_response: str


def load_flips(store: Any, where: str) -> list[Flip]:
    """Prompts whose majority verdict differs between the first and the last round that shows them."""
    rows = store.query(f"""
        SELECT run_id, dataset, prompt, step, any(gold), countIf(verdict = 1), countIf(verdict = 0),
               topK(1)(error_type)[1], any(response)
        FROM v_generations
        WHERE {where} AND stage = 'full' AND verdict IS NOT NULL
        GROUP BY run_id, dataset, prompt, step
        ORDER BY run_id, dataset, prompt, step""").rows
    rounds: dict[tuple[str, str, str], list[tuple[int, str, int | None, str, str]]] = defaultdict(list)
    for run, dataset, prompt, step, gold, right, wrong, error, response in rows:
        verdict = 1 if right > wrong else 0 if wrong > right else None
        rounds[(run, dataset, prompt)].append((int(step), str(gold), verdict, str(error), str(response)))
    flips = []
    for (run, dataset, prompt), seen in sorted(rounds.items()):
        (s0, gold, v0, e0, _), (s1, _, v1, e1, r1) = seen[0], seen[-1]
        if s0 != s1 and v0 is not None and v1 is not None and v0 != v1:
            flips.append(Flip(run, dataset, prompt, gold, s0, v0, e0 if not v0 else "", s1, v1, e1 if not v1 else "",
                              r1))
    return flips


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _verdict(v: int, error: str) -> str:
    return "right" if v else f"wrong ({error})" if error else "wrong"


def write_what_changed(flips: list[Flip], path: Path) -> Path:
    """A Markdown table of the flips, right-to-wrong ones first (they are the regressions)."""
    lines = ["# What changed: prompts whose verdict flipped between the first and the last round", ""]
    if not flips:
        lines.append("No shown prompt changed its verdict (or no run stored generations with verdicts).")
    else:
        lines += ["| run | dataset | prompt | gold | first round | last round | last response |",
                  "|---|---|---|---|---|---|---|"]
        for f in sorted(flips, key=lambda f: (f.last_verdict, f.run, f.dataset, f.prompt)):
            lines.append(f"| {_cell(f.run)} | {_cell(f.dataset)} | {_cell(f.prompt)} | {_cell(f.gold)} | "
                         f"step {f.first_step}: {_verdict(f.first_verdict, f.first_error)} | "
                         f"step {f.last_step}: {_verdict(f.last_verdict, f.last_error)} | "
                         f"{_cell(f.last_response[:RESPONSE_SHOWN])} |")
        gained = sum(f.last_verdict for f in flips)
        lines += ["", f"{gained} prompts became right, {len(flips) - gained} became wrong."]
    path.write_text("\n".join(lines) + "\n")
    return path
