"""Where the ranks of a round leave their published verdicts for adjudication (`evaluation.Board`).

`StoreBoard` is a client of the key-value store the ranks' process group
already runs (torch.distributed's TCPStore at MASTER_ADDR:MASTER_PORT, served
by rank 0): an evaluation process, inline or separate, posts and waits there
without joining the group's collectives, so the trainer never waits for it.
`MemoryBoard` is the same in one process (threads), for tests.
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta


class StoreBoard:
    def __init__(self, host: str, port: int, timeout_s: float = 60.0) -> None:
        import torch.distributed as dist

        self._store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s),
                                    wait_for_workers=False)

    def post(self, key: str, value: bytes) -> None:
        self._store.set(key, value)

    def fetch(self, key: str, timeout: float) -> bytes | None:
        try:
            self._store.wait([key], timedelta(seconds=timeout))
            return bytes(self._store.get(key))
        except Exception:  # noqa: BLE001 - gone or late: the round is voted without this adjudication
            return None


def open_board() -> StoreBoard | None:
    """The process group's store from the launcher's environment; None when there is none to reach."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    try:
        return StoreBoard(host, int(port))
    except Exception:  # noqa: BLE001 - no store: no adjudication, never a failed round
        return None


class MemoryBoard:
    def __init__(self) -> None:
        self._values: dict[str, bytes] = {}
        self._changed = threading.Condition()

    def post(self, key: str, value: bytes) -> None:
        with self._changed:
            self._values[key] = value
            self._changed.notify_all()

    def fetch(self, key: str, timeout: float) -> bytes | None:
        with self._changed:
            self._changed.wait_for(lambda: key in self._values, timeout)
            return self._values.get(key)
