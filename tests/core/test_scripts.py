"""gpumem for scripts: tagged snapshots, scopes, step metrics and the report, on the host and on FakeSource."""

from __future__ import annotations

import io
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

import gpumem
from _harness import fresh_pages
from gpumem.core.monitoring.monitor import Monitor, set_default_monitor
from gpumem.core.monitoring.peaks import KEPT_PEAK_NOTE, PEAK_RESET_NOTE, RUNNING
from gpumem.core.monitoring.spans import FIRST_TAG_NOTE, SpanRecord
from gpumem.core.readers.readings import Snapshot
from gpumem.testing import GIB, MIB, FakeSource


@pytest.fixture
def fake() -> FakeSource:
    return FakeSource()


@pytest.fixture
def mon(fake: FakeSource) -> Iterator[Monitor]:
    monitor = Monitor(fake)
    yield monitor
    monitor.stop()
    assert not RUNNING.others_running(object()), "a test left a measurement running"  # type: ignore[arg-type]


def cuda0(record: SpanRecord):
    figures = record.device(0)
    assert figures is not None
    return figures


def text_of(monitor: Monitor) -> str:
    out = io.StringIO()
    monitor.report(file=out)
    return out.getvalue()


def test_the_guides_flow_on_the_host_source_without_cuda() -> None:
    torch = pytest.importorskip("torch")
    mon = Monitor()
    try:
        plain = mon.snapshot()
        assert isinstance(plain, Snapshot)  # no tag: the plain reading, as before
        before = mon.snapshot("before_model")
        model = torch.nn.Linear(4096, 4096)
        # The model's 64 MiB may reuse memory an earlier test left resident (CI: RSS the same to the byte), so
        # the host figures are proved on 64 MiB of fresh pages made beside it.
        pages = fresh_pages(64 * MIB)
        after = mon.snapshot("after_model")
        pages.close()
        optimizer = torch.optim.Adam(model.parameters())
        model(torch.ones(8, 4096)).sum().backward()
        optimizer.step()
        last = mon.snapshot("after_optimizer")
        assert [record.label for record in mon.recorder.tags] == ["before_model", "after_model", "after_optimizer"]
        assert before.devices == after.devices == last.devices == ()  # CPU torch: no CUDA figures
        assert before.host is not None and after.host is not None and last.host is not None
        assert after.host.rss_before_bytes == before.host.rss_bytes
        assert after.host.rss_bytes >= before.host.rss_bytes + 60 * MIB
        report = text_of(mon)
        for tag in ("before_model", "after_model", "after_optimizer"):
            assert tag in report
        assert "(no CUDA)" in report and "host RSS" in report
    finally:
        mon.stop()


def test_print_of_the_report_in_a_script_prints_the_table_once(tmp_path) -> None:
    """In a real script: report() returns the table, print() writes it, once; mon.report() alone prints nothing."""
    script = tmp_path / "job.py"
    script.write_text(
        "from gpumem.core.monitoring.monitor import Monitor\n"
        "from gpumem.testing import FakeSource\n"
        "mon = Monitor(FakeSource())\n"
        "mon.snapshot('only_tag')\n"
        "mon.report()\n"
        "print('-- printed:')\n"
        "print(mon.report())\n"
        "mon.stop()\n",
        encoding="utf-8",
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    before, printed = done.stdout.split("-- printed:\n")
    assert before == ""
    assert printed.count("only_tag") == 1
    assert printed.startswith("gpumem: memory at each tag")


def test_report_writes_to_the_file_it_is_given_and_returns_the_object(
    mon: Monitor, capsys: pytest.CaptureFixture[str]
) -> None:
    mon.snapshot("only")
    out = io.StringIO()
    report = mon.report(file=out)
    assert "only" in out.getvalue() and str(report) == out.getvalue()
    assert capsys.readouterr().out == ""
    assert "<table" in report._repr_html_()


def test_tag_peaks_are_exact_since_the_previous_tag(mon: Monitor, fake: FakeSource) -> None:
    fake.transient(3 * GIB)  # before any tag: what the first tag's counter shows
    first = mon.snapshot("start")
    assert cuda0(first).peak_allocated_bytes == 3 * GIB
    assert cuda0(first).peak_note == FIRST_TAG_NOTE
    model = fake.allocate(GIB)
    fake.transient(512 * MIB)
    loaded = mon.snapshot("after_model")
    assert cuda0(loaded).allocated_bytes == GIB
    assert cuda0(loaded).allocated_before_bytes == 0
    assert cuda0(loaded).peak_allocated_bytes == GIB + 512 * MIB
    assert cuda0(loaded).peak_exact
    fake.transient(100 * MIB)
    step = mon.snapshot("after_step")
    assert cuda0(step).peak_allocated_bytes == GIB + 100 * MIB  # since after_model, not since the start
    assert cuda0(step).peak_exact
    fake.free(model)


def test_a_reset_by_the_user_makes_the_tag_peak_a_labelled_lower_bound(mon: Monitor, fake: FakeSource) -> None:
    resets = gpumem.core.monitoring.peaks.PEAK_RESETS
    mon.snapshot("start")
    fake.transient(GIB)
    with resets._lock:  # what the counting wrapper records when the user calls torch.cuda.reset_peak_memory_stats
        resets.calls[0] = resets.calls.get(0, 0) + 1
    fake.reset_peaks([0])
    figures = cuda0(mon.snapshot("after"))
    assert not figures.peak_exact
    assert figures.peak_note == PEAK_RESET_NOTE
    assert "≥" in text_of(mon)


def test_nested_scopes_each_have_an_exact_peak_in_every_iteration(mon: Monitor, fake: FakeSource) -> None:
    weights = fake.allocate(100 * MIB)
    mon.snapshot("start")  # tags and scopes together: all exact
    for _ in range(2):
        with mon.track("step") as step:
            with mon.track("forward") as forward:
                fake.transient(50 * MIB)
            with mon.track("backward") as backward:
                fake.transient(500 * MIB)
        assert step.record is not None and forward.record is not None and backward.record is not None
        assert cuda0(forward.record).peak_allocated_bytes == 150 * MIB  # below the earlier backward's: still exact
        assert cuda0(backward.record).peak_allocated_bytes == 600 * MIB
        assert cuda0(step.record).peak_allocated_bytes == 600 * MIB
        assert all(cuda0(s.record).peak_exact for s in (step, forward, backward))  # type: ignore[arg-type]
        assert forward.record.path == ("step", "forward")
    tag = mon.snapshot("end")
    assert cuda0(tag).peak_allocated_bytes == 600 * MIB and cuda0(tag).peak_exact
    report = text_of(mon)
    assert report.index("step") < report.index("  forward") < report.index("  backward")
    fake.free(weights)


def test_a_scope_left_by_an_exception_is_recorded_and_the_exception_goes_on(mon: Monitor, fake: FakeSource) -> None:
    scope = mon.track("bad")

    def failing_block() -> None:
        with scope:
            fake.transient(GIB)
            1 / 0  # noqa: B018

    with pytest.raises(ZeroDivisionError):
        failing_block()
    assert scope.record is not None and scope.record.error == "ZeroDivisionError: division by zero"
    assert cuda0(scope.record).peak_allocated_bytes == GIB
    assert "bad (raised)" in text_of(mon)


def test_measure_inside_a_scope_leaves_the_scope_exact(mon: Monitor, fake: FakeSource) -> None:
    previous = set_default_monitor(mon)
    try:
        fake.transient(2 * GIB)
        with mon.track("outer") as outer:
            with gpumem.measure("inner") as inner:
                fake.transient(GIB)
            fake.transient(512 * MIB)
        assert outer.record is not None and cuda0(outer.record).peak_exact
        assert cuda0(outer.record).peak_allocated_bytes == GIB
        assert inner.record is not None and inner.record.keep_peaks  # it left the counters to the scope
    finally:
        set_default_monitor(previous)


def test_a_scope_inside_a_measure_block_keeps_the_block_exact(mon: Monitor, fake: FakeSource) -> None:
    previous = set_default_monitor(mon)
    try:
        with gpumem.measure("outer") as outer:
            fake.transient(GIB)
            with mon.track("inner") as inner:
                fake.transient(256 * MIB)
        assert outer.record is not None and outer.record.devices[0].peak_exact
        assert outer.record.devices[0].peak_allocated_bytes == GIB
        assert inner.record is not None and not cuda0(inner.record).peak_exact
        assert cuda0(inner.record).peak_note == KEPT_PEAK_NOTE  # honest: a lower bound, and why
    finally:
        set_default_monitor(previous)


def test_scopes_on_two_threads_nest_separately(mon: Monitor, fake: FakeSource) -> None:
    paths: list[tuple[str, ...]] = []

    def worker() -> None:
        with mon.track("worker") as scope:
            pass
        assert scope.record is not None
        paths.append(scope.record.path)

    with mon.track("main"):
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
    assert paths == [("worker",)]


def test_metrics_are_a_flat_dict_with_peaks_since_the_previous_call(mon: Monitor, fake: FakeSource) -> None:
    kept = fake.allocate(GIB)
    first = mon.metrics()
    fake.transient(256 * MIB)
    second = mon.metrics()
    assert second["gpumem/cuda0/allocated_bytes"] == GIB
    assert second["gpumem/cuda0/peak_allocated_bytes"] == GIB + 256 * MIB
    assert second["gpumem/cuda0/peak_exact"] == 1.0
    assert second["gpumem/host/rss_bytes"] == fake.host_rss_bytes
    assert {"gpumem/cuda0/reserved_bytes", "gpumem/cuda0/used_bytes", "gpumem/host/peak_rss_bytes"} <= set(first)
    third = mon.metrics()
    assert third["gpumem/cuda0/peak_allocated_bytes"] == GIB  # nothing happened since the second call
    fake.free(kept)


def test_metrics_and_tags_keep_their_own_exact_peaks(mon: Monitor, fake: FakeSource) -> None:
    mon.snapshot("a")
    mon.metrics()
    fake.transient(GIB)
    mon.metrics()  # a point of another stream in the middle of the tag's interval
    fake.transient(256 * MIB)
    assert mon.metrics()["gpumem/cuda0/peak_allocated_bytes"] == 256 * MIB
    tag = cuda0(mon.snapshot("b"))
    assert tag.peak_allocated_bytes == GIB and tag.peak_exact


def test_every_n_steps_measures_every_nth_step_and_feeds_the_writers(
    mon: Monitor, tmp_path: pytest.TempPathFactory
) -> None:
    seen: list[tuple[int | None, dict[str, float]]] = []

    class ListWriter:
        def write(self, step: int | None, metrics: dict[str, float]) -> None:
            seen.append((step, metrics))

        def close(self) -> None:
            pass

    mon.add_writer(ListWriter())
    step = mon.every(3)
    results = [step() for _ in range(10)]
    assert [i + 1 for i, result in enumerate(results) if result is not None] == [3, 6, 9]
    assert [s for s, _ in seen] == [3, 6, 9]
    assert mon.step() is None  # step 11


def test_a_failing_writer_is_noted_and_the_loop_goes_on(mon: Monitor) -> None:
    class Broken:
        def write(self, step: int | None, metrics: dict[str, float]) -> None:
            raise OSError("disk full")

        def close(self) -> None:
            pass

    mon.add_writer(Broken())
    mon.every(1)
    assert mon.step() is not None
    assert mon.recorder.writer_errors == ["Broken: OSError: disk full"]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda m: m.snapshot(""), "non-empty label"),
        (lambda m: m.track("  "), "non-empty label"),
        (lambda m: m.every(0), "whole number"),
        (lambda m: m.every(True), "whole number"),
        (lambda m: m.on_threshold(1.5), "between 0 and 1"),
        (lambda m: m.on_threshold(0.9, rearm=0.95), "below the threshold"),
    ],
)
def test_bad_arguments_are_refused_with_a_sentence(mon: Monitor, call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call(mon)


def test_report_html_escapes_labels_and_text_marks_lower_bounds(mon: Monitor) -> None:
    mon.snapshot("<b>x</b>")
    html = mon.recorder.report()._repr_html_()
    assert "&lt;b&gt;x&lt;/b&gt;" in html and "<b>x" not in html


def test_an_empty_report_says_how_to_fill_it(mon: Monitor) -> None:
    assert "monitor.snapshot('name')" in str(mon.recorder.report())


def test_to_dataframe_has_a_row_per_tag_scope_and_device(mon: Monitor, fake: FakeSource) -> None:
    pytest.importorskip("pandas")
    mon.snapshot("a")
    with mon.track("s"):
        fake.transient(MIB)
    frame = mon.to_dataframe()
    assert list(frame["kind"]) == ["tag", "scope"]
    assert list(frame["label"]) == ["a", "s"]
    assert int(frame["peak_allocated_bytes"].iloc[1]) == MIB


def test_to_dataframe_without_pandas_says_what_to_install(mon: Monitor, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(ImportError, match="pip install pandas"):
        mon.to_dataframe()


def test_stop_ends_the_open_intervals(fake: FakeSource) -> None:
    mon = Monitor(fake)
    mon.snapshot("a")
    assert RUNNING.others_running(object())  # type: ignore[arg-type]
    mon.stop()
    assert not RUNNING.others_running(object())  # type: ignore[arg-type]


def test_in_ipython_the_report_is_displayed_as_html_and_not_printed(ip) -> None:
    from _harness import run_cell_capture

    ip.run_cell("from gpumem.core.monitoring.monitor import Monitor\nfrom gpumem.testing import FakeSource")
    ip.run_cell("mon = Monitor(FakeSource())\nmon.snapshot('before_model')\nmon.snapshot('after_model')")
    try:
        result, cap = run_cell_capture(ip, "mon.report()")
        assert result.success
        assert cap.stdout.startswith("Out[")  # shown once, by IPython, as the cell's result
        assert cap.stdout.count("before_model") == 1
        html = result.result._repr_html_()
        assert "before_model" in html and "<table" in html
    finally:
        ip.run_cell("mon.stop()")


def test_every_tag_is_a_tag_and_a_failed_scope_has_a_cells_status(mon: Monitor, fake: FakeSource) -> None:
    mon.snapshot("a")
    mon.snapshot("b")
    with pytest.raises(MemoryError), mon.track("s") as scope:
        fake.allocate(100 * GIB)  # past the fake device's capacity
    assert [record.kind for record in mon.recorder.tags] == ["tag", "tag"]
    assert scope.record is not None and scope.record.status == "out of memory"
    assert scope.record.error == "MemoryError: fake CUDA out of memory on device 0"
