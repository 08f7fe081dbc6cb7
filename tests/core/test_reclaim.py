"""Reclaim promises against real CPU tensors in a real IPython shell, and the allocator side against a FakeSource.

On CPU the storages are the proof: every promised storage is watched with torch's own weak storage
reference, and a test checks which died. The allocator's blocks and segments come from
:class:`gpumem.testing.FakeSource` (the caching allocator's rules, simulated), matched by address.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import pytest

from _harness import run_cell_capture

torch = pytest.importorskip("torch")

from gpumem.core.reclaim import (  # noqa: E402
    CACHE,
    EXCEPTION,
    GRADIENTS,
    OUTPUTS,
    UNBIND,
    DeviceBytes,
    NamespaceReferences,
    Outcome,
    Promise,
    ShellReferences,
    available_actions,
    perform,
    promise,
)
from gpumem.core.reclaim.promises import allocator_promise, workspace_blocks  # noqa: E402
from gpumem.core.reclaim.storages import released_storages  # noqa: E402
from gpumem.testing import MIB, FakeSource  # noqa: E402

FLOATS = 250_000  # 1,000,000 bytes a tensor


def cell(ip: Any, code: str) -> Any:
    result, _ = run_cell_capture(ip, code)
    return result


def storage_alive(ip: Any, name: str) -> bool:
    """Whether the storage watched under ``name`` (``w = t.untyped_storage()._weak_ref()``) is alive."""
    return not torch.UntypedStorage._expired(ip.user_ns[name])


# -- which storages: identity, views, other holders ---------------------------------------------------


def test_views_and_aliases_count_one_storage() -> None:
    base = torch.zeros(FLOATS)
    view = base[10:20]
    freed = released_storages([("t", ([base, view, base.view(500, 500)],))], [])
    assert list(freed.freed.values()) == [4 * FLOATS]
    assert freed.complete


def test_a_storage_another_name_reaches_is_not_promised() -> None:
    kept = torch.zeros(FLOATS)
    alone = torch.ones(FLOATS)
    found = released_storages([("Out[3]", ([kept[:5], alone],))], [("x", (kept,)), ("y", ({"a": [1, 2]},))])
    assert sum(found.freed.values()) == 4 * FLOATS
    assert sum(found.shared.values()) == 4 * FLOATS
    assert found.shared_with == ("x",)


def test_storages_only_a_kept_graph_saves_are_promised() -> None:
    weight = torch.ones(FLOATS, requires_grad=True)
    loss = (weight * weight.exp()).sum()  # saves exp's result: a storage no name reaches
    found = released_storages([("loss", (loss,))], [("weight", (weight,))])
    weight_key = ("cpu", weight.untyped_storage().data_ptr(), 4 * FLOATS)
    assert sorted(found.freed.values()) == [4, 4 * FLOATS]  # the loss, and exp's result saved by the graph
    assert weight_key not in found.freed and weight_key in found.shared  # the weight is named


def test_gradients_cut_from_their_parameters_but_not_from_a_name() -> None:
    model = torch.nn.Linear(500, 500)
    model(torch.ones(2, 500)).sum().backward()
    grads = (model.weight.grad, model.bias.grad)
    found = released_storages([("g", grads)], [("model", (model,))], cut_gradients=grads)
    assert sum(found.freed.values()) == 4 * (500 * 500 + 500)
    named = released_storages([("g", grads)], [("model", (model,)), ("gw", (model.weight.grad,))], cut_gradients=grads)
    assert sum(named.freed.values()) == 4 * 500
    assert named.shared_with == ("gw",)


# -- the allocator's units ----------------------------------------------------------------------------


def _segments(source: FakeSource) -> list[dict[str, Any]]:
    segments = source.memory_snapshot()
    assert segments is not None
    return segments


def _block_address(segments: list[dict[str, Any]], live: int) -> list[int]:
    """Addresses of the live blocks, in segment order."""
    found = []
    for segment in segments:
        address = segment["address"]
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                found.append(address)
            address += block["size"]
    assert len(found) == live
    return found


def test_blocks_round_up_and_a_segment_returns_once_every_block_in_it_is_released() -> None:
    source = FakeSource(segments=True)
    small = source.allocate(1000)  # small pool: a 512-byte multiple of a 2 MiB segment
    large = source.allocate(12 * MIB)  # a segment of its own, 12 MiB
    segments = _segments(source)
    first, second = _block_address(segments, 2)
    freed = {("cuda:0", first, 1000): 1000, ("cuda:0", second, 12 * MIB): 12 * MIB}
    devices, exact = allocator_promise(freed, segments, [0])
    assert exact
    assert devices == (DeviceBytes(0, 1024 + 12 * MIB, 2 * MIB + 12 * MIB),)
    source.free(small)
    source.free(large)
    source.empty_cache()
    reading = source.snapshot().allocator[0]
    assert (reading.allocated_bytes, reading.reserved_bytes) == (0, 0)


def test_a_segment_shared_with_a_live_block_is_not_promised_to_the_device() -> None:
    source = FakeSource(segments=True)
    source.allocate(1000)
    source.allocate(2000)  # same 2 MiB segment
    segments = _segments(source)
    first, _ = _block_address(segments, 2)
    devices, exact = allocator_promise({("cuda:0", first, 1000): 1000}, segments, [0])
    assert exact and devices == (DeviceBytes(0, 1024, 0),)


def test_without_segments_blocks_come_from_sizes_and_the_promise_is_a_bound() -> None:
    devices, exact = allocator_promise({("cuda:0", 1, 1000): 1000}, None, [0])
    assert devices == (DeviceBytes(0, 1024, 0),) and not exact


def test_workspace_blocks_are_the_live_blocks_of_a_workspace_size_no_storage_starts_at() -> None:
    source = FakeSource(segments=True)
    source.allocate(32 * MIB)
    source.allocate(32 * MIB)
    segments = _segments(source)
    first, second = _block_address(segments, 2)
    found = workspace_blocks(segments, [("cuda:0", first, 32 * MIB)], {"cuda:0": (32 * MIB, MIB)})
    assert found == [(("cuda:0", second), 32 * MIB)]


# -- texts --------------------------------------------------------------------------------------------


def test_a_broken_promise_says_why() -> None:
    promised = Promise(OUTPUTS, "Release Out[3]", (DeviceBytes(0, 4 * MIB, 20 * MIB),), 1, 4 * MIB, exact=True)
    before = (DeviceBytes(0, 10 * MIB, 40 * MIB),)
    kept = Outcome(promised, before, (DeviceBytes(0, 6 * MIB, 20 * MIB),), ("Out[3]",), 1, 0, 0, 0.01)
    assert kept.kept and "as promised" in kept.describe()
    cached = Outcome(promised, before, (DeviceBytes(0, 6 * MIB, 40 * MIB),), ("Out[3]",), 1, 0, 0, 0.01)
    assert not cached.kept and "the cache kept it" in cached.reason()
    held = Outcome(promised, before, before, ("Out[3]",), 0, 1, 4 * MIB, 0.01)
    assert "another holder appeared" in held.reason() and "4.0 MiB" in held.reason()
    assert promised.button_text() == "Release Out[3]: 4.0 MiB"
    assert promised._replace(exact=False).button_text() == "Release Out[3]: up to 4.0 MiB"


# -- the actions, in a real shell ----------------------------------------------------------------------


def test_releasing_out_frees_exactly_the_promised_storage(ip: Any) -> None:
    cell(ip, "import torch")
    number = cell(ip, f"torch.ones({FLOATS})").execution_count
    cell(ip, f"w = Out[{number}].untyped_storage()._weak_ref()")
    held = ShellReferences(ip)
    assert OUTPUTS in available_actions(held)
    promised = promise(OUTPUTS, held, FakeSource())
    assert (promised.storage_count, promised.storage_bytes, promised.exact) == (1, 4 * FLOATS, True)
    assert promised.label == f"Release Out[{number}]"
    assert storage_alive(ip, "w")
    outcome = perform(OUTPUTS, held, FakeSource())
    assert not storage_alive(ip, "w")
    assert (outcome.storages_freed, outcome.storages_alive) == (1, 0) and outcome.kept, outcome.describe()
    assert any(f"Out[{number}]" in item for item in outcome.released)


def test_outputs_without_tensors_are_left_in_out(ip: Any) -> None:
    cell(ip, "import torch")
    text = cell(ip, "'some text'").execution_count
    number = cell(ip, f"torch.ones({FLOATS})").execution_count
    outcome = perform(OUTPUTS, ShellReferences(ip), FakeSource())
    assert outcome.promise.label == f"Release Out[{number}]"
    assert ip.user_ns["Out"][text] == "some text" and number not in ip.user_ns["Out"]


def test_out_also_bound_to_a_name_promises_nothing_and_names_the_holder(ip: Any) -> None:
    cell(ip, "import torch")
    number = cell(ip, f"torch.ones({FLOATS})").execution_count
    cell(ip, f"x = Out[{number}]")
    promised = promise(OUTPUTS, ShellReferences(ip), FakeSource())
    assert promised.storage_bytes == 0 and promised.kept_bytes == 4 * FLOATS and "x" in promised.kept_by
    assert "also held by x" in promised.describe()


def test_last_exception_frames(ip: Any) -> None:
    cell(ip, "import torch")
    body = f"big = torch.ones({FLOATS})\n    global w\n    w = big.untyped_storage()._weak_ref()\n    1 / 0"
    cell(ip, f"def step():\n    {body}")
    cell(ip, "step()")
    held = ShellReferences(ip)
    assert EXCEPTION in available_actions(held)
    promised = promise(EXCEPTION, held, FakeSource())
    assert promised.storage_bytes == 4 * FLOATS
    outcome = perform(EXCEPTION, held, FakeSource())
    assert not storage_alive(ip, "w") and outcome.storages_freed == 1 and outcome.kept


def test_gradients_of_a_model(ip: Any) -> None:
    cell(ip, "import torch\nmodel = torch.nn.Linear(500, 500)\nmodel(torch.ones(2, 500)).sum().backward()")
    cell(ip, "w = model.weight.grad.untyped_storage()._weak_ref()")
    held = ShellReferences(ip)
    assert f"{GRADIENTS}:model" in available_actions(held)
    promised = promise(f"{GRADIENTS}:model", held, FakeSource())
    assert promised.storage_bytes == 4 * (500 * 500 + 500) and promised.label == "Drop model's gradients"
    outcome = perform(f"{GRADIENTS}:model", held, FakeSource())
    assert ip.user_ns["model"].weight.grad is None and not storage_alive(ip, "w") and outcome.storages_freed == 2
    assert f"{GRADIENTS}:model" not in available_actions(held)


def test_unbind_names_what_else_holds_the_storage(ip: Any) -> None:
    cell(ip, f"import torch\na = torch.ones({FLOATS})\nb = a[:10]\nc = torch.ones({FLOATS})")
    held = ShellReferences(ip)
    shared = promise(f"{UNBIND}:a", held, FakeSource())
    assert shared.storage_bytes == 0 and shared.kept_by == ("b",)
    alone = perform(f"{UNBIND}:c", held, FakeSource())
    assert "c" not in ip.user_ns and alone.storages_freed == 1 and alone.kept


def test_the_cache_alone_returns_the_free_segments(fake_monitor: Any) -> None:
    source: FakeSource = FakeSource(segments=True)
    handle = source.allocate(12 * MIB)
    source.free(handle)
    torch_cuda = sys.modules["torch"].cuda
    if not torch_cuda.is_initialized():
        with pytest.raises(LookupError):
            promise(CACHE, NamespaceReferences({}), source)
        assert perform(CACHE, NamespaceReferences({}), source).error == "CUDA is not initialized"


def test_an_unknown_or_stale_action_is_an_outcome_not_a_traceback(ip: Any) -> None:
    outcome = perform(f"{UNBIND}:missing", ShellReferences(ip), FakeSource())
    assert outcome.error == "missing is not bound" and not outcome.kept
    assert "failed" in outcome.describe()


def test_an_action_from_another_thread_while_a_cell_runs_leaves_the_aliases(ip: Any) -> None:
    cell(ip, "import torch, time")
    number = cell(ip, f"torch.ones({FLOATS})").execution_count
    cell(ip, f"w = Out[{number}].untyped_storage()._weak_ref()")
    results: list[Outcome] = []

    def click() -> None:
        time.sleep(0.3)
        results.append(perform(OUTPUTS, ShellReferences(ip), FakeSource()))

    thread = threading.Thread(target=click)
    thread.start()
    began = time.perf_counter()
    cell(ip, "time.sleep(1.5)")
    thread.join()
    assert results and results[0].elapsed_s < 1.0 and time.perf_counter() - began >= 1.5
    outcome = results[0]
    # `_` still points to the tensor (the display hook owns it while the cell runs): promised nothing, kept
    assert outcome.promise.storage_bytes == 0 and "_" in outcome.promise.kept_by
    assert number not in ip.user_ns["Out"] and storage_alive(ip, "w")
