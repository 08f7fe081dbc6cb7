import os
import sys
from collections.abc import Callable

import pytest

from gpumem.core.readers import devices
from gpumem.core.readers.nvml import _normal_bus_id
from gpumem.core.readers.sources import (
    HostSource,
    NvmlSource,
    SystemSource,
    TorchAllocatorSource,
    parse_visible_devices,
)


def test_the_visible_devices_parser_is_still_importable_from_here():
    assert parse_visible_devices is devices.parse_visible_devices


def test_bus_ids_compare_across_nvml_and_torch_spelling():
    assert _normal_bus_id("00000000:1A:00.0") == "0:1a:0"
    assert _normal_bus_id("0000:1a:00.0") == "0:1a:0"


def test_host_source_reads_this_process():
    reading = HostSource().read()
    assert reading is not None
    assert 10 * 2**20 < reading.rss_bytes < reading.total_bytes
    assert reading.peak_rss_bytes >= reading.rss_bytes
    assert 0 < reading.available_bytes <= reading.total_bytes


def test_host_rss_follows_a_real_allocation():
    numpy = pytest.importorskip("numpy")
    source = HostSource()
    before = source.read()
    block = numpy.ones(128 * 2**20, dtype=numpy.uint8)
    after = source.read()
    assert before is not None and after is not None
    grown = after.rss_bytes - before.rss_bytes
    assert 0.9 * block.nbytes < grown < 1.2 * block.nbytes


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/statm is Linux's")
def test_host_rss_from_statm_is_psutils_figure_and_psutil_takes_over_when_it_fails(monkeypatch):
    psutil = pytest.importorskip("psutil")
    from gpumem.core.readers import sources

    source = HostSource()
    process = psutil.Process()
    reading = source.read()
    assert reading is not None and source._statm is not None
    assert source._statm._pread is not None  # libc's pread, called with the GIL held
    pairs = [(source.read().rss_bytes, process.memory_info().rss) for _ in range(5)]
    assert any(ours == theirs for ours, theirs in pairs), pairs  # the same figure when nothing moved between reads

    def broken(self):
        raise OSError("statm went away")

    monkeypatch.setattr(sources._Statm, "rss_bytes", broken)
    fallback = source.read()
    assert fallback is not None and source._statm is None
    assert abs(fallback.rss_bytes - process.memory_info().rss) < 16 * 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/meminfo is Linux's")
def test_machine_memory_from_meminfo_is_psutils_figure_and_psutil_takes_over_without_it(monkeypatch):
    psutil = pytest.importorskip("psutil")
    from gpumem.core.readers import sources

    source = HostSource()
    assert source._meminfo is not None and source._meminfo._pread is not None  # read with the GIL held
    pairs = []
    for _ in range(5):
        reading = source.read(machine_max_age_s=0.0)
        assert reading is not None
        memory = psutil.virtual_memory()
        assert reading.total_bytes == memory.total
        pairs.append((reading.available_bytes, memory.available))
    assert any(ours == theirs for ours, theirs in pairs), pairs  # the same figure when nothing moved between reads
    # A kernel that does not report MemAvailable: psutil (which then estimates it) from now on.
    monkeypatch.setattr(sources._Meminfo, "read", lambda self: b"MemTotal:       1024 kB\nMemFree:        512 kB\n")
    fallback = source.read(machine_max_age_s=0.0)
    assert fallback is not None and source._meminfo is None
    assert fallback.total_bytes == psutil.virtual_memory().total
    assert sources._meminfo_kib(b"MemTotal:       1024 kB\nMemAvailable:    256 kB\n", b"MemAvailable:") == 256


def test_torch_source_says_why_it_is_unavailable_without_touching_cuda(monkeypatch):
    source = TorchAllocatorSource()
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert source.unavailable_reason() == (
        "torch is installed but not imported in this process yet (gpumem never imports it; `import torch` does)"
    )
    assert source.devices() == ()


def test_torch_source_on_a_cpu_build_explains_itself():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this check is for machines without CUDA")
    reason = TorchAllocatorSource().unavailable_reason()
    assert reason is not None
    assert "CUDA" in reason
    assert TorchAllocatorSource().devices() == ()
    assert not torch.cuda.is_initialized()


def test_nvml_without_driver_gives_a_reason_not_an_error():
    nvml = NvmlSource()
    reason = nvml.unavailable_reason()
    if reason is None:
        pytest.skip("an NVIDIA driver is present")
    assert "NVML" in reason or "GPU" in reason or "nvidia-ml-py" in reason
    assert nvml.devices() == ()
    assert nvml.read(0) is None


def test_system_snapshot_without_gpu_has_host_and_reasons():
    source = SystemSource()
    snapshot = source.snapshot()
    assert snapshot.host is not None
    status = source.status()
    assert set(status) == {"torch", "nvml", "host"}
    assert status["host"] == "ok"
    for name in ("torch", "nvml"):
        assert status[name] == "ok" or status[name].startswith("unavailable: ")
    if not snapshot.allocator:
        assert status["torch"].startswith("unavailable: ")


def test_nvml_source_resets_itself_in_a_forked_child():
    if not hasattr(os, "fork"):
        pytest.skip("no fork on this platform")
    nvml = NvmlSource()
    nvml.unavailable_reason()

    def resets() -> bool:
        ok = nvml._pid == os.getpid() or (nvml.unavailable_reason() is not None or nvml.devices() is not None)
        return ok and nvml._pid == os.getpid()

    assert _in_forked_child(resets)


def _in_forked_child(check: Callable[[], bool]) -> bool:
    """Run ``check`` in a forked child; its answer, sent back through a pipe."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(write, b"1" if check() else b"0")
        finally:
            os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    answer = os.read(read, 1)
    os.close(read)
    assert status == 0
    return answer == b"1"


@pytest.mark.skipif(not hasattr(os, "fork") or not sys.platform.startswith("linux"), reason="fork and /proc: Linux")
def test_host_rss_in_a_forked_child_is_the_childs_own():
    """The statm file opened in the parent names the parent's process even in a child: the child opens its own."""
    pytest.importorskip("psutil")
    source = HostSource()
    assert source.read() is not None and source._statm is not None

    def own_figure() -> bool:
        block = bytearray(256 * 2**20)  # zero-filled pages: resident in the child only
        block[:: 4096] = b"\x01" * len(block[:: 4096])
        with open(f"/proc/{os.getpid()}/statm", "rb") as own:  # noqa: PTH123 - the child's figure, read afresh
            expected = int(own.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        reading = source.read()
        return reading is not None and abs(reading.rss_bytes - expected) < 16 * 2**20

    assert _in_forked_child(own_figure)
