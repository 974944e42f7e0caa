"""A fake CUDA runtime for the tests of the client's device paths (score regions and KV
pools opened by CUDA IPC handle), on a machine without a GPU.

:class:`FakeCudart` stands in for libcudart under ``cuda_runtime.CudaRuntime`` and logs
the calls; :class:`ShmAsDeviceMemory` makes an "opened handle" map one of the daemon's
own shared-memory objects, so that what the client writes through its "device" tensor is
what a real daemon reads, and the daemon's decisions check it; :func:`install` puts both
in place of the real runtime for one test.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable, Dict, Optional

from kvcache_client import cuda_runtime
from kvcache_client import region as region_module
from kvcache_client.cuda_runtime import CudaRuntime, IpcMapping

UUID = "GPU-8c1b2f1e-0a1b-4c2d-9e3f-00112233aabb"
OTHER_UUID = "GPU-00000000-1111-2222-3333-444444444444"
BUS = "0000:3B:00.0"
ERRORS = {100: b"no CUDA-capable device is detected", 101: b"invalid device ordinal",
          201: b"invalid device context", 400: b"invalid resource handle"}


class FakeCudart:
    """The runtime functions cuda_runtime calls, on a made-up machine: ``devices`` maps a
    PCI bus id to this process's ordinal. Out-parameters come as ctypes pointers, as the
    real library gets them. ``open_memory(handle)`` gives the pointer an opened handle maps
    (default: a fixed fake address); ``log`` (shared with a test) records the calls."""

    def __init__(self, devices: Dict[str, int], log: Optional[list] = None) -> None:
        self.devices = devices
        self.current = 0
        self.log = log if log is not None else []
        self.open_error = 0
        self.open_memory = lambda handle: 0x7F0000000000
        self.close_memory = lambda pointer: None

    def cudaGetErrorString(self, code):
        return ERRORS.get(code, b"unknown error")

    def cudaDeviceGetByPCIBusId(self, device_p, bus_id):
        self.log.append(("by_bus_id", bus_id.decode()))
        if bus_id.decode().upper() not in self.devices:
            return 101
        device_p.contents.value = self.devices[bus_id.decode().upper()]
        return 0

    def cudaDeviceGetPCIBusId(self, text, length, device):
        for bus_id, ordinal in self.devices.items():
            if ordinal == device:
                text.value = bus_id.encode()[:length - 1]
                return 0
        return 101

    def cudaGetDevice(self, device_p):
        device_p.contents.value = self.current
        return 0

    def cudaSetDevice(self, device):
        self.log.append(("set_device", device))
        self.current = device
        return 0

    def cudaIpcOpenMemHandle(self, pointer_p, handle, flags):
        self.log.append(("open", bytes(handle), flags, self.current))
        if self.open_error:
            return self.open_error
        pointer_p.contents.value = self.open_memory(bytes(handle))
        return 0

    def cudaIpcCloseMemHandle(self, pointer):
        self.log.append(("close", pointer.value))
        self.close_memory(pointer.value)
        return 0


class ShmAsDeviceMemory:
    """What the fake runtime maps for a handle: the daemon's own shared-memory object,
    whose name the test's handle carries, so that the "device" writes are the daemon's to
    read and its decisions check them."""

    def __init__(self) -> None:
        self.open: Dict[int, tuple] = {}

    def handle_for(self, shm_name: str) -> bytes:
        return shm_name.encode().ljust(64, b"\0")

    def map(self, handle: bytes) -> int:
        shm = region_module._attach(handle.rstrip(b"\0").decode())
        array = (ctypes.c_uint8 * shm.size).from_buffer(shm.buf)
        pointer = ctypes.addressof(array)
        self.open[pointer] = (shm, array)
        return pointer

    def unmap(self, pointer: int) -> None:
        shm, array = self.open.pop(pointer)
        del array
        shm.close()


def install(monkeypatch: Any, fake: FakeCudart, memory: ShmAsDeviceMemory, *,
            uuid_of: Callable[[int], Optional[str]] = lambda device: UUID) -> None:
    """For the test's duration: ``cuda_runtime.runtime()`` is ``fake`` (each opened handle
    mapping ``memory``), and an :class:`IpcMapping`'s tensor is a host uint8 tensor over
    the mapped bytes (torch here has no CUDA)."""
    import torch
    fake.open_memory, fake.close_memory = memory.map, memory.unmap
    monkeypatch.setattr(cuda_runtime, "runtime", lambda: CudaRuntime(fake, uuid_of=uuid_of))
    monkeypatch.setattr(IpcMapping, "as_tensor", lambda self: torch.frombuffer(
        (ctypes.c_uint8 * self.byte_size).from_address(self.pointer), dtype=torch.uint8))
