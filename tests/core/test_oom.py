"""The out-of-memory assistant: a real torch.OutOfMemoryError in a real IPython shell; figures from a fake source."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

from _harness import run_cell_capture

torch = pytest.importorskip("torch")

from gpumem.core.diagnoses import oom  # noqa: E402
from gpumem.ipython.oom_explainer import install, uninstall  # noqa: E402
from gpumem.testing import FakeSource  # noqa: E402

GIB = 1 << 30
MIB = 1 << 20

TORCH2_MESSAGE = (
    "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.11 GiB of which "
    "13.40 GiB is free. Including non-PyTorch memory, this process has 65.70 GiB memory in use. Of the "
    "allocated memory 44.50 GiB is allocated by PyTorch, and 21.00 GiB is reserved by PyTorch but unallocated. "
    "If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
    "to avoid fragmentation.  See documentation for Memory Management"
)
TORCH1_MESSAGE = (
    "CUDA out of memory. Tried to allocate 2.00 MiB (GPU 1; 15.78 GiB total capacity; 14.56 GiB already "
    "allocated; 1.44 MiB free; 14.70 GiB reserved in total by PyTorch)"
)
NOT_FRAGMENTED = (
    "CUDA out of memory. Tried to allocate 8.00 GiB. GPU 0 has a total capacity of 79.11 GiB of which "
    "1.00 GiB is free. Of the allocated memory 77.00 GiB is allocated by PyTorch, and 100.00 MiB is reserved "
    "by PyTorch but unallocated."
)


@pytest.fixture
def installed(ip: Any) -> Iterator[tuple[Any, FakeSource]]:
    source = FakeSource()
    install(ip, source=source, holder_device="cpu")
    try:
        yield ip, source
    finally:
        uninstall(ip)


def outputs_text(captured: Any) -> str:
    return "\n".join(output.data.get("text/plain", "") for output in captured.outputs)


def outputs_html(captured: Any) -> str:
    return "\n".join(output.data.get("text/html", "") for output in captured.outputs)


def test_parse_torch2_message() -> None:
    figures = oom.parse_oom_message(TORCH2_MESSAGE)
    assert figures.device == 0
    assert figures.requested_bytes == 20 * GIB
    assert figures.device_total_bytes == int(79.11 * GIB)
    assert figures.device_free_bytes == int(13.40 * GIB)
    assert figures.process_bytes == int(65.70 * GIB)
    assert figures.allocated_bytes == int(44.50 * GIB)
    assert figures.reserved_unallocated_bytes == 21 * GIB


def test_parse_torch1_message() -> None:
    figures = oom.parse_oom_message(TORCH1_MESSAGE)
    assert figures.device == 1
    assert figures.requested_bytes == 2 * MIB
    assert figures.device_total_bytes == int(15.78 * GIB)
    assert figures.device_free_bytes == int(1.44 * MIB)
    assert figures.allocated_bytes == int(14.56 * GIB)
    assert figures.reserved_unallocated_bytes == int(14.70 * GIB) - int(14.56 * GIB)


def test_parse_unrelated_message_gives_nothing() -> None:
    assert all(value is None for value in oom.parse_oom_message("something else"))


def test_find_oom_error_by_class_message_and_chain() -> None:
    direct = torch.OutOfMemoryError(TORCH2_MESSAGE)
    assert oom.find_oom_error(direct) is direct
    legacy = RuntimeError("CUDA out of memory. Tried to allocate 2.00 MiB")
    assert oom.find_oom_error(legacy) is legacy

    def training() -> None:
        try:
            raise direct
        except torch.OutOfMemoryError as inner:
            raise ValueError("training failed") from inner

    with pytest.raises(ValueError, match="training failed") as chained:
        training()
    assert oom.find_oom_error(chained.value) is direct
    assert oom.find_oom_error(ValueError("no")) is None
    assert oom.find_oom_error(None) is None


def test_explained_beneath_the_error_and_the_kernel_stays_usable(installed: Any) -> None:
    ip, source = installed
    source.allocate(44 * GIB)
    run_cell_capture(ip, "import torch, weakref\nholder = torch.zeros(100_000)")
    run_cell_capture(ip, "torch.zeros(50_000)")
    failed, captured = run_cell_capture(
        ip,
        "def step():\n"
        "    activations = torch.zeros(200_000)\n"
        "    refs.append(weakref.ref(activations))\n"
        f"    raise torch.OutOfMemoryError({TORCH2_MESSAGE!r})\n"
        "refs = []\n"
        "step()",
    )
    assert isinstance(failed.error_in_exec, torch.OutOfMemoryError)
    text = outputs_text(captured)
    assert "gpumem: CUDA out of memory on cuda:0" in text
    assert "requested 20.0 GiB; free on the device 13.4 GiB of 79.1 GiB" in text
    assert "allocated 44.5 GiB, reserved but unallocated 21.0 GiB (fragmentation)" in text
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in text
    assert re.search(r"top holders:\n\s+holder\s+Tensor\s+390\.6 KiB", text)
    hidden_rows = r"held by IPython .*\n\s+last exception \(OutOfMemoryError\)\s+OutOfMemoryError\s+781\.2 KiB"
    assert re.search(hidden_rows, text)
    assert re.search(r"Out\[\d+\]\s+Tensor\s+195\.3 KiB", text)
    assert "IPython itself holds 976.6 KiB" in text
    assert "%gpumem free --deep" in text
    assert "<code>%gpumem free --deep</code>" in outputs_html(captured)
    after, captured_after = run_cell_capture(ip, "1 + 1")
    assert after.success and after.result == 2
    assert "gpumem" not in outputs_text(captured_after)
    from gpumem.core.cleanup import free

    free(deep=True, shell=ip, source=source)
    assert ip.user_ns["refs"][0]() is None


def test_observer_figures_win_over_the_message(installed: Any) -> None:
    ip, _ = installed
    _, captured = run_cell_capture(
        ip,
        "import torch\n"
        "from gpumem.core.diagnoses import oom\n"
        f"oom._observer(0, {3 * GIB}, {80 * GIB}, {1 * GIB})\n"
        "raise torch.OutOfMemoryError('CUDA out of memory.')",
    )
    text = outputs_text(captured)
    assert "requested 3.0 GiB; free on the device 1.0 GiB of 80.0 GiB" in text


def test_observation_from_an_earlier_cell_is_not_used(installed: Any) -> None:
    ip, _ = installed
    run_cell_capture(ip, f"from gpumem.core.diagnoses import oom\noom._observer(0, {3 * GIB}, {80 * GIB}, {1 * GIB})")
    _, captured = run_cell_capture(ip, f"import torch\nraise torch.OutOfMemoryError({NOT_FRAGMENTED!r})")
    text = outputs_text(captured)
    assert "requested 8.0 GiB" in text
    assert "fragmentation" not in text.lower()


def test_request_larger_than_the_device() -> None:
    error = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 37252.90 GiB. GPU 0 has a total capacity of 139.81 GiB of which "
        "139.00 GiB is free. Of the allocated memory 0 bytes is allocated by PyTorch, and 0 bytes is reserved "
        "by PyTorch but unallocated."
    )
    report = oom.explain(error, source=FakeSource())
    assert any("larger than the whole device" in item for item in report.advice)
    assert not any("returns what is freed" in item for item in report.advice)
    assert not report.fragmentation


def test_figures_missing_from_the_message_come_from_the_source() -> None:
    source = FakeSource()
    handle = source.allocate(3 * GIB)
    source.free(handle)
    source.allocate(1 * GIB)
    report = oom.explain(RuntimeError("CUDA out of memory. Tried to allocate 1.50 GiB (GPU 0)"), source=source)
    assert report.figures.allocated_bytes == 1 * GIB
    assert report.figures.reserved_unallocated_bytes == 2 * GIB
    assert report.fragmentation
    assert report.figures.device_free_bytes is None
    assert "free on the device n/a" in oom.render_text(report)


def test_other_errors_show_nothing(installed: Any) -> None:
    ip, _ = installed
    _, captured = run_cell_capture(ip, "raise ValueError('not memory')")
    assert "gpumem" not in outputs_text(captured)


def test_a_failing_explanation_never_breaks_the_cell(installed: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    ip, _ = installed

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("internal")

    monkeypatch.setattr(oom, "explain", broken)
    failed, captured = run_cell_capture(ip, f"import torch\nraise torch.OutOfMemoryError({TORCH2_MESSAGE!r})")
    assert isinstance(failed.error_in_exec, torch.OutOfMemoryError)
    assert "gpumem: could not explain the out-of-memory error (RuntimeError: internal)" in captured.stdout
    assert run_cell_capture(ip, "2 + 2")[0].result == 4


def test_uninstall_removes_the_hooks_and_silences_the_observer(ip: Any) -> None:
    explainer = install(ip, source=FakeSource())
    assert install(ip, source=FakeSource()) is explainer  # idempotent
    assert ip.events.callbacks["post_run_cell"].count(explainer.post_run_cell) == 1
    uninstall(ip)
    assert explainer.post_run_cell not in ip.events.callbacks["post_run_cell"]
    assert explainer.pre_run_cell not in ip.events.callbacks["pre_run_cell"]
    oom._observer(0, 1, 2, 3)
    assert oom._state.last_observation is None
    _, captured = run_cell_capture(ip, f"import torch\nraise torch.OutOfMemoryError({TORCH2_MESSAGE!r})")
    assert "gpumem" not in outputs_text(captured)
    uninstall(ip)  # twice is fine


def test_no_dangling_then_and_no_row_of_n_a() -> None:
    """Free memory short of the request, but nothing named holds it: no lone "Then ..." step."""
    message = (
        "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
        "1.50 GiB is free. Of the allocated memory 70.00 GiB is allocated by PyTorch, and 10.00 MiB is reserved "
        "by PyTorch but unallocated."
    )
    report = oom.explain(torch.OutOfMemoryError(message), source=FakeSource())
    assert not any(item.startswith("Then") for item in report.advice)
    assert oom.render_text(report).count("%gpumem free --deep") == 1
    bare = oom.explain(torch.OutOfMemoryError("CUDA out of memory."), source=FakeSource(cuda_initialized=False))
    text = oom.render_text(bare)
    assert "n/a" not in text and "the error states no sizes" in text
    assert "n/a" not in oom.render_html(bare)


FRAGMENTED_OOM = (
    "CUDA out of memory. Tried to allocate 2.40 GiB. GPU 0 has a total capacity of 12.49 GiB of which "
    "0 bytes is free. Of the allocated memory 7.03 GiB is allocated by PyTorch, and 4.97 GiB is reserved "
    "by PyTorch but unallocated."
)


@pytest.fixture
def segmented(ip: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, FakeSource]]:
    """The explainer over a fake allocator that keeps PyTorch's segments and blocks."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    source = FakeSource(segments=True)
    install(ip, source=source, holder_device="cpu")
    ip.user_ns["src"] = source
    try:
        yield ip, source
    finally:
        uninstall(ip)


def test_a_fragmentation_oom_is_not_told_to_return_a_cache_that_returns_nothing(segmented: Any) -> None:
    """12 x 1 GiB freed, 12 x 600 MiB taken: 5 GiB free in 424 MiB pieces, each beside a live tensor."""
    ip, _source = segmented
    run_cell_capture(
        ip,
        "import torch\n"
        "for h in [src.allocate(1 << 30) for _ in range(12)]:\n"
        "    src.free(h)\n"
        "parts = [src.allocate(600 << 20) for _ in range(12)]",
    )
    _, captured = run_cell_capture(ip, f"raise torch.OutOfMemoryError({FRAGMENTED_OOM!r})")
    text = outputs_text(captured)
    assert (
        "PyTorch: allocated 7.0 GiB, reserved but unallocated 5.0 GiB in 12 pieces, the largest 424.0 MiB "
        "(fragmentation)"
    ) in text
    assert (
        "Fragmentation: PyTorch holds 5.0 GiB reserved but unallocated, more than the request, but in 12 pieces, "
        "the largest 424.0 MiB. For the next kernel, set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before "
        "torch initializes CUDA: `%env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` in the first cell, or "
        'os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True" before `import torch`. '
        "`%gpumem free` (torch.cuda.empty_cache()) would return none of it: every free piece shares a segment "
        "with a live tensor, and goes back only when those tensors are deleted."
    ) in text
    assert "return the cache with" not in text


def test_a_free_piece_large_enough_means_it_was_not_fragmentation(segmented: Any) -> None:
    """The reserve now has a free 3 GiB block: a 2.4 GiB request fits, so fragmentation was not the cause."""
    _ip, source = segmented
    source.transient(3 * GIB)
    report = oom.explain(torch.OutOfMemoryError(FRAGMENTED_OOM), source=source)
    assert not report.fragmentation
    assert report.free_reserve is not None and report.free_reserve.largest_free_bytes == 3 * GIB
    assert not any("expandable_segments" in item for item in report.advice)


def test_the_free_advice_names_what_empty_cache_returns(segmented: Any) -> None:
    _ip, source = segmented
    for handle in [source.allocate(GIB) for _ in range(12)]:
        source.free(handle)
    [source.allocate(600 * MIB) for _ in range(12)]
    source.transient(2 * GIB)  # an empty 2 GiB segment: still too small for 2.4 GiB, but empty_cache returns it
    report = oom.explain(torch.OutOfMemoryError(FRAGMENTED_OOM), source=source)
    assert report.fragmentation
    (advice,) = [item for item in report.advice if item.startswith("Fragmentation")]
    assert "but in 13 pieces, the largest 2.0 GiB." in advice
    assert advice.endswith(
        "`%gpumem free` (torch.cuda.empty_cache()) returns 2.0 GiB of it to the device now "
        "(the segments no tensor uses)."
    )


def test_a_request_just_above_the_device_size_shows_the_bytes_that_differ() -> None:
    error = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 139.82 GiB. GPU 0 has a total capacity of 139.81 GiB of which "
        "137.90 GiB is free. Of the allocated memory 0 bytes is allocated by PyTorch, and 0 bytes is reserved "
        "by PyTorch but unallocated."
    )
    report = oom.explain(error, source=FakeSource())
    (advice,) = [item for item in report.advice if "larger than the whole device" in item]
    asked, whole = (int(figure.replace(",", "")) for figure in re.findall(r"\(([\d,]+) B\)", advice))
    assert asked > whole
