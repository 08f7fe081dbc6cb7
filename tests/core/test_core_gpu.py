"""Measurement core on a real CUDA GPU: exact counters, no context of our own, fork safety, device matching."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _run(script: str, env: dict[str, str] | None = None, timeout: float = 120) -> dict:
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = SRC + os.pathsep + full_env.get("PYTHONPATH", "")
    if env:
        full_env.update(env)
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_one_gib_tensor_is_one_gib_to_the_byte():
    result = _run(
        """
        import json, torch
        from gpumem.core.readers.sources import SystemSource
        source = SystemSource()
        torch.zeros(1, device="cuda:0")
        before = source.snapshot().allocator_for(0)
        block = torch.empty(2**30, dtype=torch.uint8, device="cuda:0")
        after = source.snapshot().allocator_for(0)
        print(json.dumps({"delta": after.allocated_bytes - before.allocated_bytes,
                          "reserved_delta": after.reserved_bytes - before.reserved_bytes,
                          "public": torch.cuda.memory_allocated(0) - before.allocated_bytes,
                          "status": source.status()}))
        """
    )
    assert result["delta"] == 2**30
    assert result["public"] == 2**30
    assert result["reserved_delta"] >= 2**30
    assert result["status"]["torch"] == "ok"


def test_sampler_before_cuda_use_creates_no_context_and_fork_still_works():
    result = _run(
        """
        import json, os, time
        import torch
        from gpumem.core.monitoring.monitor import Monitor
        monitor = Monitor(rate_hz=200).start()
        time.sleep(0.5)
        snap = monitor.snapshot(process_memory=True)
        own_context = [d.process_used_bytes for d in snap.devices]
        listed = [monitor.source.nvml.process_on_device(d.device) for d in snap.devices]
        initialized = torch.cuda.is_initialized()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            ok = 0
            try:
                x = torch.ones(1024, device="cuda:0")
                ok = 1 if float(x.sum()) == 1024.0 else 0
            finally:
                os.write(write, bytes([ok]))
                os._exit(0)
        os.close(write)
        _, status = os.waitpid(pid, 0)
        child_ok = os.read(read, 1) == b"\\x01"
        monitor.stop()
        print(json.dumps({"initialized": initialized, "own_context": own_context, "listed": listed,
                          "nvml_devices": len(snap.devices), "allocator": len(snap.allocator),
                          "child_ok": child_ok, "status": os.waitstatus_to_exitcode(status)}))
        """
    )
    assert result["nvml_devices"] >= 1
    assert result["initialized"] is False
    assert result["allocator"] == 0
    assert not any(result["listed"]), result
    assert result["child_ok"] is True
    assert result["status"] == 0


def test_device_info_matches_torch_by_uuid():
    result = _run(
        """
        import json, torch
        from gpumem.core.readers.sources import SystemSource
        source = SystemSource()
        torch.zeros(1, device="cuda:0")
        source.snapshot()
        matches = []
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            info = source.device_info(i)
            matches.append({"torch_uuid": str(props.uuid), "nvml_uuid": info.uuid if info else None,
                            "total_equal": info is not None and info.total_bytes >= props.total_memory})
        print(json.dumps(matches))
        """
    )
    for match in result:
        assert match["nvml_uuid"] is not None
        assert match["nvml_uuid"].removeprefix("GPU-") == match["torch_uuid"].removeprefix("GPU-")
        assert match["total_equal"]


def test_uuid_in_cuda_visible_devices_maps_before_and_after_init():
    uuid = _run(
        """
        import json, pynvml
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        last = pynvml.nvmlDeviceGetHandleByIndex(count - 1)
        value = pynvml.nvmlDeviceGetUUID(last)
        print(json.dumps({"uuid": value.decode() if isinstance(value, bytes) else value, "index": count - 1}))
        """
    )
    result = _run(
        """
        import json, torch
        from gpumem.core.readers.sources import SystemSource
        source = SystemSource()
        before = source.device_info(0)
        torch.zeros(1, device="cuda:0")
        source.snapshot()
        after = source.device_info(0)
        print(json.dumps({"before": before.uuid, "after": after.uuid, "nvml_index": after.nvml_index,
                          "devices": list(source.nvml.devices())}))
        """,
        env={"CUDA_VISIBLE_DEVICES": uuid["uuid"]},
    )
    assert result["before"] == uuid["uuid"]
    assert result["after"] == uuid["uuid"]
    assert result["nvml_index"] == uuid["index"]
    assert result["devices"] == [0]


def test_untouched_devices_get_no_context():
    result = _run(
        """
        import json, torch
        from gpumem.core.monitoring.monitor import Monitor
        monitor = Monitor(rate_hz=100).start()
        torch.zeros(1, device="cuda:0")
        import time; time.sleep(0.3)
        snap = monitor.snapshot()
        listed = {d.device: monitor.source.nvml.process_on_device(d.device) for d in snap.devices}
        monitor.stop()
        print(json.dumps({"listed": listed, "count": torch.cuda.device_count()}))
        """
    )
    assert result["listed"]["0"] is True
    for device, present in result["listed"].items():
        if device != "0":
            assert present is False, result


def test_memory_read_with_the_gil_held_matches_pynvml_once_cuda_is_up():
    result = _run(
        """
        import json, pynvml, torch
        from gpumem.core.readers.sources import SystemSource
        source = SystemSource()
        before = source.snapshot()  # CUDA not initialized yet: pynvml's own call
        torch.zeros(1, device="cuda:0")
        source.snapshot()
        nvml = source.nvml
        handle = nvml._handles[0]
        held = nvml._held.read(handle)
        plain = pynvml.nvmlDeviceGetMemoryInfo(handle)
        reading = nvml.read(0, hold_gil=True)
        print(json.dumps({"held": [held.total, held.used, held.free], "plain": [plain.total, plain.used, plain.free],
                          "reading_total": reading.total_bytes, "holding": nvml.reads_holding_gil,
                          "too_slow": nvml._held.too_slow, "before_devices": len(before.devices)}))
        """
    )
    assert result["holding"] and not result["too_slow"]
    assert result["held"][0] == result["plain"][0] == result["reading_total"]
    assert abs(result["held"][1] - result["plain"][1]) <= 2 * 2**20  # read a few microseconds apart
    assert result["before_devices"] >= 1
