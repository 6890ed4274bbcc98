"""metrics.jsonl read back with the writer that wrote it: every record in order, a last line a
crash cut short skipped, any other broken line an error naming where."""

import pytest

from headrace.metrics import records
from headrace.metrics.records import last_record, read_records
from headrace.metrics.sinks import JsonlSink
from headrace.rundir import RunDir


def _write(run_dir, n):
    sink = JsonlSink(RunDir(run_dir).metrics)
    for step in range(n):
        sink.write(step, {"learner/step": step, "loss/total": 0.5 * step})
    sink.close()


def test_reads_what_the_sink_wrote(tmp_path):
    _write(tmp_path, 5)
    got = read_records(tmp_path)
    assert [r["step"] for r in got] == list(range(5))
    assert got[3]["loss/total"] == 1.5
    assert read_records(RunDir(tmp_path).metrics) == got  # the file itself, or its folder
    assert last_record(tmp_path) == got[-1]


def test_a_cut_short_last_line_is_skipped_and_logged(tmp_path, caplog):
    _write(tmp_path, 3)
    with open(RunDir(tmp_path).metrics, "a") as handle:
        handle.write('{"time": 1.0, "step": 3, "learner/st')
    assert [r["step"] for r in read_records(tmp_path)] == [0, 1, 2]
    assert "cut short" in caplog.text
    assert last_record(tmp_path)["step"] == 2


def test_a_broken_line_before_the_last_is_an_error(tmp_path):
    _write(tmp_path, 2)
    path = RunDir(tmp_path).metrics
    path.write_text(path.read_text() + "not json\n" + '{"step": 9}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:3: not a metrics record"):
        read_records(tmp_path)
    assert last_record(tmp_path)["step"] == 9


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_records(tmp_path)
    assert read_records(tmp_path, missing_ok=True) == []
    assert last_record(tmp_path) is None


def test_last_record_reads_only_the_tail(tmp_path, monkeypatch):
    monkeypatch.setattr(records, "TAIL_BYTES", 200)  # shorter than the file, longer than a line
    _write(tmp_path, 50)
    assert RunDir(tmp_path).metrics.stat().st_size > 1000
    assert last_record(tmp_path)["step"] == 49
