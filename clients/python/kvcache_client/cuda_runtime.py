"""A small ctypes binding to the CUDA runtime: what device score regions and CUDA KV pools
need.

A daemon deciding on a GPU (``kvcached --engine_backend=cuda``) creates score regions in
its device memory and hands out a CUDA IPC handle (``CreatedScoreRegion``); a daemon
holding its KV pools on the GPUs (``--backend=cuda``) exports each rank's pool so
(``KvPool``). Mapping either takes five runtime calls (find the GPU by PCI bus id, open
and close the handle, error strings, the current device), so this module binds them with
ctypes instead of adding a Python dependency.

Nothing is loaded before a device region or pool is opened: importing kvcache_client
never loads CUDA. The library is the libcudart this process already has (torch's, when
torch was imported with CUDA), else one in torch's folders, else
``ctypes.util.find_library``, else ``libcudart.so.13``/``.12``/``.11`` by soname.

The GPU is found by the PCI bus id the daemon sends and checked by UUID where torch can
tell it (``torch.cuda.get_device_properties(i).uuid``): ordinals differ between processes
(``CUDA_VISIBLE_DEVICES``), bus ids and UUIDs do not. Failures are KvCacheError:
FAILED_PRECONDITION when this process cannot reach that GPU (no runtime, not visible, a
different GPU at that bus id), INTERNAL with the runtime's message when a CUDA call fails.

Thread-safety: :func:`runtime` is; an :class:`IpcMapping` is closed by its owner only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys
import threading
from typing import Any, Callable, List, Optional

import grpc

from .errors import KvCacheError

__all__ = ["CudaRuntime", "IpcMapping", "open_ipc_export", "runtime"]

#: cudaIpcMemLazyEnablePeerAccess: the handle may be opened on a GPU other than the
#: exporter's (peer access is then enabled for it).
IPC_LAZY_ENABLE_PEER_ACCESS = 1
#: sizeof(cudaIpcMemHandle_t)
IPC_HANDLE_BYTES = 64
_SONAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so.11",
            "libcudart.so")


class IpcMemHandle(ctypes.Structure):
    """cudaIpcMemHandle_t, passed by value."""

    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


class CudaRuntime:
    """The runtime calls a device region makes, over ``lib``: the loaded libcudart, or in
    tests any object with the same functions (out-parameters arrive as ctypes pointers).
    ``uuid_of(ordinal)`` gives a GPU's UUID, or None when it cannot be told."""

    def __init__(self, lib: Any, *, name: str = "libcudart",
                 uuid_of: Optional[Callable[[int], Optional[str]]] = None) -> None:
        self._lib = lib
        self.name = name
        self._uuid_of = uuid_of if uuid_of is not None else torch_device_uuid

    def error_string(self, code: int) -> str:
        text = self._lib.cudaGetErrorString(code)
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return f"{text or 'unknown CUDA error'} (cudaError {code})"

    def _check(self, code: int, what: str,
               status: grpc.StatusCode = grpc.StatusCode.INTERNAL) -> None:
        if code != 0:
            raise KvCacheError(status, f"{what}: {self.error_string(code)}")

    def device_by_pci_bus_id(self, bus_id: str) -> int:
        """This process's ordinal of the GPU at ``bus_id``; FAILED_PRECONDITION when it
        sees none there."""
        device = ctypes.c_int(-1)
        self._check(self._lib.cudaDeviceGetByPCIBusId(ctypes.pointer(device),
                                                      bus_id.encode()),
                    f"no GPU at PCI bus id {bus_id} is visible to this process "
                    "(CUDA_VISIBLE_DEVICES, or a daemon on another node?); "
                    "cudaDeviceGetByPCIBusId", grpc.StatusCode.FAILED_PRECONDITION)
        return device.value

    def pci_bus_id(self, device: int) -> str:
        text = ctypes.create_string_buffer(32)
        self._check(self._lib.cudaDeviceGetPCIBusId(text, len(text), device),
                    f"cudaDeviceGetPCIBusId({device})")
        return text.value.decode()

    def device_uuid(self, device: int) -> Optional[str]:
        """``GPU-...`` of ordinal ``device``, or None when it cannot be told here."""
        uuid = self._uuid_of(device)
        return None if uuid is None else normalize_uuid(uuid)

    def current_device(self) -> int:
        device = ctypes.c_int(0)
        self._check(self._lib.cudaGetDevice(ctypes.pointer(device)), "cudaGetDevice")
        return device.value

    def set_device(self, device: int) -> None:
        self._check(self._lib.cudaSetDevice(device), f"cudaSetDevice({device})")

    def ipc_open(self, handle: bytes, device: int) -> int:
        """cudaIpcOpenMemHandle of ``handle`` on ordinal ``device`` (made current for the
        call, then restored); returns the device pointer."""
        if len(handle) != IPC_HANDLE_BYTES:
            raise KvCacheError(grpc.StatusCode.INTERNAL,
                               f"a CUDA IPC handle of {len(handle)} bytes; "
                               f"cudaIpcMemHandle_t has {IPC_HANDLE_BYTES}")
        previous = self.current_device()
        if previous != device:
            self.set_device(device)
        try:
            pointer = ctypes.c_void_p()
            self._check(self._lib.cudaIpcOpenMemHandle(
                ctypes.pointer(pointer), IpcMemHandle.from_buffer_copy(handle),
                IPC_LAZY_ENABLE_PEER_ACCESS),
                f"cudaIpcOpenMemHandle on device {device}")
        finally:
            if previous != device:
                self.set_device(previous)  # only when changed: no context made on it
        if not pointer.value:
            raise KvCacheError(grpc.StatusCode.INTERNAL,
                               "cudaIpcOpenMemHandle returned a null pointer")
        return pointer.value

    def ipc_close(self, pointer: int) -> None:
        self._check(self._lib.cudaIpcCloseMemHandle(ctypes.c_void_p(pointer)),
                    "cudaIpcCloseMemHandle")

    def find_device(self, uuid: str, bus_id: str) -> int:
        """This process's ordinal of the GPU with ``uuid`` at ``bus_id`` (the daemon's
        names for it). Found by bus id (by UUID through torch when no bus id is given) and,
        where this process can tell UUIDs, refused unless the UUIDs agree."""
        want = normalize_uuid(uuid) if uuid else None
        if bus_id:
            device = self.device_by_pci_bus_id(bus_id)
        elif want:
            device = self._device_by_uuid(want)
        else:
            raise KvCacheError(grpc.StatusCode.FAILED_PRECONDITION,
                               "the daemon named its region's GPU by neither PCI bus id "
                               "nor UUID")
        have = self.device_uuid(device) if want else None
        if want and have is not None and have != want:
            raise KvCacheError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the GPU at PCI bus id {bus_id} is {have} here, but the daemon's region "
                f"is on {want}: not the same GPU (another node, or a container with "
                "another view of the bus?)")
        return device

    def _device_by_uuid(self, want: str) -> int:
        torch = sys.modules.get("torch")
        count = torch.cuda.device_count() if torch is not None else 0
        for device in range(count):
            if self.device_uuid(device) == want:
                return device
        raise KvCacheError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"no GPU with UUID {want} among the {count} this process sees")


def normalize_uuid(uuid: Any) -> str:
    """``GPU-xxxxxxxx-...`` in lower case, whether given with or without the prefix (the
    daemon sends it with, torch prints it without)."""
    text = str(uuid).strip().lower()
    return "GPU-" + (text[4:] if text.startswith("gpu-") else text)


def torch_device_uuid(device: int) -> Optional[str]:
    """The UUID torch reports for ordinal ``device``; None when this torch has none (the
    attribute came with torch 2.x) or torch has no CUDA here."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return None if uuid is None else str(uuid)


class IpcMapping:
    """One opened CUDA IPC handle: ``byte_size`` bytes at ``pointer`` on ``device`` (this
    process's ordinal). Exposes them through ``__cuda_array_interface__`` as a flat uint8
    array, so ``torch.as_tensor(mapping, device=...)`` (or CuPy, Numba) views them; a tensor
    made so keeps this object alive, and must not outlive :meth:`close`."""

    def __init__(self, cuda: CudaRuntime, pointer: int, byte_size: int, device: int) -> None:
        self._cuda = cuda
        self.pointer = pointer
        self.byte_size = byte_size
        self.device = device

    @property
    def __cuda_array_interface__(self) -> dict:
        if not self.pointer:
            raise ValueError("the CUDA IPC mapping is closed")
        # No "stream": the daemon zero-fills and synchronizes the region before it hands
        # out the handle, so a consumer has nothing to wait for.
        return {"shape": (self.byte_size,), "typestr": "|u1", "data": (self.pointer, False),
                "strides": None, "version": 3}

    def as_tensor(self) -> Any:
        """A torch uint8 CUDA tensor over the whole mapping."""
        import torch
        return torch.as_tensor(self, device=torch.device("cuda", self.device))

    def close(self) -> None:
        """cudaIpcCloseMemHandle, once. REQUIRES: no tensor over it is used again."""
        pointer, self.pointer = self.pointer, 0
        if pointer:
            self._cuda.ipc_close(pointer)


def open_ipc_export(exported: Any, cuda: Optional[CudaRuntime] = None) -> IpcMapping:
    """Maps device memory the daemon exported by CUDA IPC handle on this process's ordinal
    of its GPU: anything with ``cuda_ipc_handle``, ``bytes``, ``device_uuid`` and
    ``device_pci_bus_id`` (a ``CreatedScoreRegion`` or a ``KvPool`` of backend "cuda")."""
    cuda = cuda if cuda is not None else runtime()
    device = cuda.find_device(exported.device_uuid, exported.device_pci_bus_id)
    pointer = cuda.ipc_open(bytes(exported.cuda_ipc_handle), device)
    return IpcMapping(cuda, pointer, int(exported.bytes), device)


# -- loading --------------------------------------------------------------------------------

_lock = threading.Lock()
_runtime: Optional[CudaRuntime] = None


def runtime() -> CudaRuntime:
    """The process's CudaRuntime, loaded on first use; FAILED_PRECONDITION when no
    libcudart can be loaded (the reasons for each candidate in the message)."""
    global _runtime
    with _lock:
        if _runtime is None:
            _runtime = _load()
        return _runtime


def _load() -> CudaRuntime:
    tried: List[str] = []
    for candidate in _candidates():
        try:
            lib = ctypes.CDLL(candidate)
        except OSError as error:
            tried.append(f"{candidate}: {error}")
            continue
        _declare(lib)
        return CudaRuntime(lib, name=candidate)
    raise KvCacheError(grpc.StatusCode.FAILED_PRECONDITION,
                       "a CUDA score region or KV pool needs the CUDA runtime (libcudart), "
                       "and none could be loaded: " + ("; ".join(tried) or "none found"))


def _candidates() -> List[str]:
    found: List[str] = []
    found += _loaded_cudart()   # whatever this process runs already: torch's, ideally
    found += _torch_cudart()
    named = ctypes.util.find_library("cudart")
    if named:
        found.append(named)
    found += list(_SONAMES)
    unique: List[str] = []
    for path in found:
        if path not in unique:
            unique.append(path)
    return unique


def _loaded_cudart() -> List[str]:
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith("libcudart"))


def _torch_cudart() -> List[str]:
    """libcudart next to torch (its wheels bundle one, or depend on nvidia-cuda-runtime),
    when torch is imported and built with CUDA."""
    torch = sys.modules.get("torch")
    if torch is None or not getattr(torch.version, "cuda", None):
        return []
    root = os.path.dirname(os.path.dirname(torch.__file__))  # site-packages
    patterns = [os.path.join(os.path.dirname(torch.__file__), "lib", "libcudart*.so*"),
                os.path.join(root, "nvidia", "cuda_runtime", "lib", "libcudart*.so*")]
    return sorted(path for pattern in patterns for path in glob.glob(pattern))


def _declare(lib: ctypes.CDLL) -> None:
    """The signatures, so that ctypes passes pointers and the handle struct right."""
    c_int_p, c_void_pp = ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_void_p)
    signatures = {
        "cudaGetErrorString": ([ctypes.c_int], ctypes.c_char_p),
        "cudaDeviceGetByPCIBusId": ([c_int_p, ctypes.c_char_p], ctypes.c_int),
        "cudaDeviceGetPCIBusId": ([ctypes.c_char_p, ctypes.c_int, ctypes.c_int],
                                  ctypes.c_int),
        "cudaGetDevice": ([c_int_p], ctypes.c_int),
        "cudaSetDevice": ([ctypes.c_int], ctypes.c_int),
        "cudaIpcOpenMemHandle": ([c_void_pp, IpcMemHandle, ctypes.c_uint], ctypes.c_int),
        "cudaIpcCloseMemHandle": ([ctypes.c_void_p], ctypes.c_int),
    }
    for name, (arguments, result) in signatures.items():
        function = getattr(lib, name)
        function.argtypes = arguments
        function.restype = result
