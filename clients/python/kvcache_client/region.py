"""ScoreRegion: a POSIX shared-memory object that kvcached reads a worker's scores from.

On the daemon's node, scores need not travel through gRPC: the worker writes them into a
shared-memory region it registered (``RegisterScoreRegion``; the daemon must run with
``--allow_shm_scores``), and each report names its range (``ScoreRef``) instead of carrying
the bytes. ``client.batch(score_region_bytes=N)`` and ``client.stream(score_region_bytes=N)``
make one and use it on every step; nothing else changes for the caller.

Layout and ownership: every batch of reports is written from the start of its window (the
whole region, or with N batches in flight a stream's 1/N of it), each report's range at the
next multiple of :data:`ALIGNMENT` bytes, packed exactly as its inline ``scores`` bytes would
be. The daemon reads a range until the Decision for the report that named it has arrived; a
stream reuses a window only after the decisions of the batch that last wrote it. A report
that does not fit in what is left of the window goes inline (counted in
:attr:`ScoreRegion.inline_reports`).

With ``from_daemon=True`` the daemon creates the object instead (``CreateScoreRegion``)
and this class maps it; the daemon owns it and frees it on ``close``. A daemon deciding on
a GPU (``--engine_backend=cuda``) creates it in its GPU's memory: this class then opens its
CUDA IPC handle (:mod:`~kvcache_client.cuda_runtime`: the GPU found by PCI bus id, checked
by UUID) on this process's ordinal of that GPU, and the scores of torch tensors are copied
into it on the current stream, device to device; before a batch naming them is sent, the
stream waits for a CUDA event recorded after the last write (:meth:`wait_for_writes`).

:attr:`ScoreRegion.tensor` is the whole region as a flat torch uint8 tensor, over the
shared memory or the device memory alike (one code path for both; CI runs it on host
memory, against the emulated device engine): a view of the daemon's memory, valid until
``close``.

Otherwise the object is created with a random name and mode 0600 (so the daemon must run as the same
user, or root, and see the same /dev/shm), is not handed to multiprocessing's resource
tracker (which would unlink it behind the batch's back, or warn about it), and is
unregistered and unlinked by :meth:`ScoreRegion.close` (or, failing that, unlinked when the
object is collected or the interpreter exits).
"""

from __future__ import annotations

import importlib
import os
import secrets
import weakref
from multiprocessing import shared_memory
from typing import TYPE_CHECKING, Any, Optional

import grpc

from .errors import KvCacheError

if TYPE_CHECKING:
    from .client import KvCacheClient
    from .cuda_runtime import IpcMapping
    from .results import CreatedScoreRegion
    from .scores import PreparedScores

__all__ = ["ALIGNMENT", "ScoreRegion"]

#: Every report's range starts at a multiple of this many bytes (a cache line; also a
#: multiple of every score dtype's size).
ALIGNMENT = 64


class ScoreRegion:
    """One registered shared-memory score region (see the module docstring).

    Not thread-safe: its stream writes one batch at a time (under the stream's lock).
    """

    def __init__(self, client: "KvCacheClient", byte_size: int, *,
                 from_daemon: bool = False, rank: Optional[int] = None) -> None:
        """Creates the object (``byte_size`` bytes) and registers it with the daemon, or
        (``from_daemon``) has the daemon create it, on tensor-parallel rank ``rank``'s GPU
        when given (CreateScoreRegionRequest.rank), and maps it.

        Raises:
          ValueError: ``byte_size`` below 1.
          KvCacheError: FAILED_PRECONDITION when the daemon does not take shared-memory
            scores (started without --allow_shm_scores), or made the region in device
            memory this process cannot reach (no CUDA runtime, its GPU not visible here,
            another GPU by UUID at that bus id); INTERNAL when a CUDA call fails;
            INVALID_ARGUMENT when it cannot open the object (another user, another
            /dev/shm); RESOURCE_EXHAUSTED past its region limits. Nothing is left behind.
        """
        if int(byte_size) < 1:
            raise ValueError(f"score_region_bytes must be >= 1, got {byte_size}")
        self.byte_size = int(byte_size)
        self._client = client
        self._shm: Optional[shared_memory.SharedMemory] = None
        self._mapping: Optional["IpcMapping"] = None  # device memory: the opened handle
        self._tensor: Any = None  # `tensor`, made on first use
        self._event: Any = None   # device memory: the CUDA event each batch waits for
        self._unwaited = False    # device memory: written since the last wait_for_writes
        if from_daemon:
            self._attach_created(client, rank)
        else:
            self._create_and_register(client)
        self._buf: Optional[memoryview] = self._shm.buf if self._shm is not None else None
        self._cursor = 0
        self._window = (0, self.byte_size)  # where the current batch may write
        self.region_reports = 0   #: reports whose scores went through the region
        self.inline_reports = 0   #: reports that did not fit and went inline
        self.high_water_bytes = 0  #: the most bytes one batch used
        self.closed = False

    def _attach_created(self, client: "KvCacheClient", rank: Optional[int]) -> None:
        try:
            created = (client.create_score_region(self.byte_size) if rank is None
                       else client.create_score_region(self.byte_size, rank=rank))
        except KvCacheError as error:
            raise _explained(error, client) from None
        self.region_id = created.region
        if created.backend == "cuda":
            self._attach_device(client, created)
            return
        if created.backend != "host" or not created.shm_name:
            client.unregister_score_region(created.region)
            raise KvCacheError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"kvcached at {client.address} created score region {created.region} in "
                f"memory of backend {created.backend or 'unknown'!r}, which this client "
                "cannot map")
        try:
            self._shm = _attach(created.shm_name)
        except BaseException:
            client.unregister_score_region(created.region)
            raise
        self.name = created.shm_name
        self._finalizer = weakref.finalize(self, lambda: None)  # the daemon's to unlink

    def _attach_device(self, client: "KvCacheClient", created: "CreatedScoreRegion") -> None:
        from . import cuda_runtime  # loads CUDA: only for a region in device memory
        try:
            # The region's tensor needs torch; imported first, its libcudart is the one used.
            importlib.import_module("torch")
        except ImportError:
            client.unregister_score_region(created.region)
            raise KvCacheError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"kvcached at {client.address} created score region {created.region} in the "
                f"memory of GPU {created.device_uuid}; writing there takes torch with CUDA, "
                "which this process cannot import") from None
        try:
            self._mapping = cuda_runtime.open_ipc_export(created)
            self._tensor = self._mapping.as_tensor()[:self.byte_size]
        except BaseException:
            self._tensor = None
            try:
                if self._mapping is not None:
                    self._mapping.close()
            finally:
                client.unregister_score_region(created.region)
            raise
        self.name = f"cuda-ipc:{created.region}@{created.device_uuid}"
        # Nothing to do when collected unclosed: a tensor over the mapping may outlive this
        # object, and the mapping goes with the process. The daemon never drops a device
        # region for idleness (it cannot see whether the handle is still open): one that is
        # never closed stays allocated, charged to its limit, until the daemon exits.
        self._finalizer = weakref.finalize(self, lambda: None)

    def _create_and_register(self, client: "KvCacheClient") -> None:
        self._shm = _create(self.byte_size)
        self.name: str = self._shm._name  # type: ignore[attr-defined]  # "/kvcm-...": shm_open's
        self._finalizer = weakref.finalize(self, _unlink, self.name, os.getpid())
        try:
            self.region_id = client.register_score_region(self.name, self.byte_size)
        except BaseException as error:
            self._release()
            if isinstance(error, KvCacheError):
                raise _explained(error, client) from None
            raise

    # -- the memory --------------------------------------------------------------------------

    @property
    def on_device(self) -> bool:
        """Whether the region is GPU memory (a daemon's, opened by IPC handle)."""
        return self._mapping is not None

    @property
    def device(self) -> str:
        """Where :attr:`tensor` lives: ``"cpu"``, or ``"cuda:N"`` (N: this process's
        ordinal of the daemon's GPU)."""
        mapping = getattr(self, "_mapping", None)
        return f"cuda:{mapping.device}" if mapping is not None else "cpu"

    @property
    def tensor(self) -> Any:
        """The whole region, ``byte_size`` bytes, as a flat torch uint8 tensor on
        :attr:`device`: a view of the memory the daemon reads (writes through it are what
        a ScoreRef names). Valid until :meth:`close`; needs torch."""
        if self.closed:
            raise KvCacheError(grpc.StatusCode.CANCELLED, f"score region {self.name} is closed")
        if self._tensor is None:
            import torch
            self._tensor = torch.frombuffer(self._buf[:self.byte_size],  # type: ignore[index]
                                            dtype=torch.uint8)
        return self._tensor

    def wait_for_writes(self) -> None:
        """Returns once the GPU has done this batch's writes into the region: records a
        CUDA event on the current stream of the region's GPU after the last write and waits
        for that event (not for the whole device). Nothing to wait for in host memory,
        where a write is done when it returns. The stream calls it once per batch, after
        building the batch and before sending it."""
        if not self._unwaited:
            return
        self._unwaited = False
        self._event = _wait_for_current_stream(self._mapping.device,  # type: ignore[union-attr]
                                               self._event)

    # -- one batch at a time ---------------------------------------------------------------

    def begin_batch(self, start: int = 0, end: Optional[int] = None) -> None:
        """Starts a batch writing bytes [start, end) (default: the whole region).
        REQUIRES: the decisions of the batch that last wrote there have all arrived (the
        daemon is done reading it)."""
        end = self.byte_size if end is None else end
        if not 0 <= start <= end <= self.byte_size:
            raise ValueError(f"score region window [{start}, {end}) is not within its "
                             f"{self.byte_size} bytes")
        self._window = (start, end)
        self._cursor = start

    def place(self, scores: "PreparedScores") -> Optional[int]:
        """Writes ``scores`` at the next aligned offset and returns it, or returns None
        (counted in ``inline_reports``) when they do not fit in what is left."""
        if self.closed:
            raise KvCacheError(grpc.StatusCode.CANCELLED, f"score region {self.name} is closed")
        offset = -(-self._cursor // ALIGNMENT) * ALIGNMENT
        end = offset + scores.nbytes
        if end > self._window[1]:
            self.inline_reports += 1
            return None
        if self._mapping is not None or scores.from_tensor:
            # copy_ on the current stream, straight into the region (on the GPU: no host copy)
            scores.write_into_tensor(self.tensor[offset:end])
            self._unwaited = self._mapping is not None
        else:
            scores.write_into(self._buf[offset:end])  # type: ignore[index]
        self._cursor = end
        self.region_reports += 1
        self.high_water_bytes = max(self.high_water_bytes, end - self._window[0])
        return offset

    # -- life ------------------------------------------------------------------------------

    def close(self) -> None:
        """Unregisters the region (the daemon unmaps it), then unlinks the object. Call it
        only when no report naming the region awaits its Decision. A daemon that is gone or
        has already dropped the region (--idle_timeout) is not an error here."""
        if self.closed:
            return
        self.closed = True
        if self._mapping is not None:
            self._close_device()
            return
        try:
            self._unregister()
        finally:
            self._release()

    def _unregister(self) -> None:
        try:
            self._client.unregister_score_region(self.region_id)
        except KvCacheError:
            pass  # NOT_FOUND (dropped), UNAVAILABLE (gone): it holds no mapping of ours

    def _close_device(self) -> None:
        """Device memory: our tensor dropped and the handle closed before the daemon is
        told to free the memory (a mapping of freed device memory must not outlive it)."""
        try:
            self.wait_for_writes()  # a batch that failed after writing: let its copies end
        finally:
            self._tensor = None
            try:
                self._mapping.close()  # type: ignore[union-attr]
            finally:
                self._unregister()

    def _release(self) -> None:
        self._buf = None
        self._tensor = None  # frees its view of the mapping (unless the caller holds one)
        try:
            self._shm.close()  # type: ignore[union-attr]
        except BufferError:
            # A view of it is still alive (a tensor or memoryview the caller kept): that
            # view keeps the mapping, which goes with the last view. Close the descriptor
            # now, and let collecting the object not try (and warn) again.
            self._shm._mmap = None  # type: ignore[union-attr]
            self._shm.close()  # type: ignore[union-attr]
        self._finalizer()  # unlinks, once

    def __enter__(self) -> "ScoreRegion":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"ScoreRegion(name={getattr(self, 'name', None)!r}, "
                f"byte_size={self.byte_size}, device={self.device!r}, "
                f"region_id={getattr(self, 'region_id', None)}, "
                f"region_reports={getattr(self, 'region_reports', 0)}, "
                f"inline_reports={getattr(self, 'inline_reports', 0)})")


def _wait_for_current_stream(device: int, event: Any) -> Any:
    """Records ``event`` (a new one when None) on the current stream of GPU ``device`` and
    waits for it; returns it for the next batch."""
    import torch
    if event is None:
        event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    event.synchronize()
    return event


def _create(byte_size: int) -> shared_memory.SharedMemory:
    """A new object of a random name, mode 0600, untracked by the resource tracker."""
    for _ in range(16):
        name = f"kvcm-{secrets.token_hex(12)}"
        try:
            try:
                return shared_memory.SharedMemory(name=name, create=True, size=byte_size,
                                                  track=False)  # Python >= 3.13
            except TypeError:
                pass
            shm = shared_memory.SharedMemory(name=name, create=True, size=byte_size)
        except FileExistsError:
            continue
        # Before 3.13 the creator registers it with the resource tracker, which unlinks
        # (and warns about) what is still registered when the process exits. We unlink it
        # ourselves, so take it back off the tracker's list.
        from multiprocessing import resource_tracker
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        return shm
    raise FileExistsError("no free shared-memory name for a score region after 16 tries")


def _explained(error: KvCacheError, client: "KvCacheClient") -> KvCacheError:
    """``error``, with what to do when the daemon takes no score regions at all."""
    if error.code != grpc.StatusCode.FAILED_PRECONDITION:
        return error
    return KvCacheError(
        error.code,
        f"kvcached at {client.address} does not take shared-memory scores: start it with "
        f"--allow_shm_scores, or make the batch without score_region_bytes ({error.message})")


def _attach(name: str) -> shared_memory.SharedMemory:
    """Maps the daemon's object ``name`` ("/..."), untracked by the resource tracker (the
    daemon unlinks it, not this process)."""
    bare = name.lstrip("/")
    try:
        return shared_memory.SharedMemory(name=bare, track=False)  # Python >= 3.13
    except TypeError:
        pass
    shm = shared_memory.SharedMemory(name=bare)
    # Before 3.13 even attaching registers the name with the resource tracker, which would
    # unlink the daemon's object when this process exits.
    from multiprocessing import resource_tracker
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    return shm


def _unlink(name: str, owner_pid: Optional[int] = None) -> None:
    """shm_unlink without the resource tracker (which no longer knows the name); nothing
    in a forked child (``owner_pid`` is the creator's), whose exit must not remove it."""
    if owner_pid is not None and os.getpid() != owner_pid:
        return
    try:
        import _posixshmem  # CPython's, what SharedMemory itself calls
        _posixshmem.shm_unlink(name)
    except FileNotFoundError:
        pass
    except ImportError:  # pragma: no cover - non-CPython
        try:
            os.unlink("/dev/shm" + name)
        except FileNotFoundError:
            pass
