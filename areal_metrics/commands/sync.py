"""`sync [--run ID]`: send what the client journaled while the broker was away.

Every journal under `<AREAL_HOME>/journal/` (one per run and rank, plus the CLI's) is
re-sent in order; a record leaves its journal only once the broker acknowledged it,
and it keeps its event_id, so a sync that is cut short or repeated never counts twice.
A journal in use (its run is still alive and re-sends it itself) is left alone.
Exit 0 when every journal is empty afterwards, 1 when some events stay undelivered.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from areal_metrics.producers.contract.ids import RUN_ID_RULE, is_valid_run_id
from areal_metrics.producers.contract.settings import Settings, state_dir

from areal_metrics.errors import ServiceUnavailable, UserError
from areal_metrics.commands.arguments import seconds


def add_arguments(parser: argparse.ArgumentParser, verb: str) -> None:
    parser.add_argument("--run", dest="run_id", metavar="ID", help="only this run's journals (default: every journal)")
    parser.add_argument("--timeout", type=seconds, default=30.0,
                        help="seconds to wait for the broker per journal (default 30)")


def journals(root: Path, run_id: str | None = None) -> list[Path]:
    """The journal folders under `root` (of one run when given), in a stable order."""
    base = root / run_id if run_id else root
    if not base.is_dir():
        return []
    return sorted(p.parent for p in base.rglob("journal.log") if p.is_file())


def _has_events(folder: Path) -> bool:
    """Whether a journal holds events (emptied once all were acknowledged; an unreadable one: maybe)."""
    try:
        return (folder / "journal.log").stat().st_size > 0
    except OSError:
        return True


def run(args: argparse.Namespace) -> int:
    from areal_metrics.producers.delivery.journal import JournalLocked
    from areal_metrics.producers.delivery.publisher import Publisher
    from areal_metrics.producers.runtime.kafka_wait import bootstrap_reachable

    if args.run_id is not None and not is_valid_run_id(args.run_id):
        raise UserError(f"--run {args.run_id[:60]!r}: must be {RUN_ID_RULE}")
    settings = Settings.from_env()
    root = state_dir() / "journal"
    sent = busy = 0
    left: list[str] = []
    unreadable: list[str] = []
    found = journals(root, args.run_id)
    pending = [f for f in found if _has_events(f)]
    if pending and not bootstrap_reachable(settings.kafka_bootstrap.split(",")):
        # nothing accepts a connection: no journal would be sent, and each would wait --timeout for it
        raise ServiceUnavailable(f"not delivered: no broker accepts a connection at {settings.kafka_bootstrap}; "
                                 f"{len(pending)} journal(s) with events kept (start it, then run sync again)")
    for folder in found:
        try:
            publisher = Publisher.from_settings(settings, journal_dir=folder, close_at_exit=False)
        except JournalLocked:
            busy += 1
            continue
        except OSError as exc:  # not this user's, a folder where a file goes: the others are still sent
            unreadable.append(f"{folder} ({exc.strerror or exc})")
            continue
        done = not publisher.journal.has_pending() or publisher.flush(args.timeout)
        publisher.close(timeout=1.0)
        sent += publisher.stats().resent
        if not done:
            left.append(str(folder))
    note = f"; {busy} journal(s) in use by a live run, which re-sends them itself" if busy else ""
    if unreadable:
        note += f"; {len(unreadable)} journal(s) could not be opened: {', '.join(unreadable[:3])}"
    if left:
        raise ServiceUnavailable(
            f"not delivered: the broker at {settings.kafka_bootstrap} did not acknowledge the journal(s) "
            f"{', '.join(left[:3])}{' …' if len(left) > 3 else ''} within {args.timeout:g} s; run sync again{note}")
    if unreadable:
        raise UserError(f"synced {sent} event(s) to {settings.kafka_bootstrap}{note}")
    print(f"synced {sent} event(s) to {settings.kafka_bootstrap}{note}")
    return 0

