"""The publisher's on-disk journal: order, acknowledgement cursor, crash safety."""

import pytest

from areal_metrics.producers.delivery.journal import Journal, JournalLocked


def test_append_read_advance_in_order(tmp_path):
    j = Journal(tmp_path)
    for i in range(5):
        j.append("t", b"run", b'{"i": %d}' % i)
    first = j.read(2)
    assert [r.value for r in first] == [b'{"i": 0}', b'{"i": 1}']
    j.advance(first[-1].end)
    assert [r.value for r in j.read(10)] == [b'{"i": %d}' % i for i in range(2, 5)]
    j.advance(j.read(10)[-1].end)
    assert not j.has_pending()
    assert (tmp_path / "journal.log").stat().st_size == 0  # truncated once all is acknowledged
    j.close()


def test_pending_records_survive_a_restart(tmp_path):
    j = Journal(tmp_path)
    for i in range(3):
        j.append("t", b"k", b"v%d" % i)
    j.advance(j.read(1)[0].end)
    j.close()
    again = Journal(tmp_path)
    assert [r.value for r in again.read(10)] == [b"v1", b"v2"]
    again.close()


def test_torn_last_line_is_dropped(tmp_path):
    j = Journal(tmp_path)
    j.append("t", b"k", b"whole")
    j.close()
    with open(tmp_path / "journal.log", "ab") as f:
        f.write(b"t\tk\thalf-writ")  # a crash in the middle of an append
    again = Journal(tmp_path)
    assert [r.value for r in again.read(10)] == [b"whole"]
    again.append("t", b"k", b"next")
    assert [r.value for r in again.read(10)] == [b"whole", b"next"]
    again.close()


def test_one_publisher_per_journal(tmp_path):
    j = Journal(tmp_path)
    with pytest.raises(JournalLocked):
        Journal(tmp_path)
    j.close()
    Journal(tmp_path).close()
