"""Starting a kvcached of our own for the evaluation: ephemeral loopback ports, host
shared-memory KV pools shaped like the decoder's cache, shared-memory score regions."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import List, Optional

REPO_ROOT = Path(__file__).resolve().parents[2]


def kvcached_binary(explicit: Optional[str] = None) -> Path:
    """``explicit``, else $KVCM_KVCACHED, else build/bin/kvcached of this checkout."""
    return Path(explicit or os.environ.get("KVCM_KVCACHED")
                or REPO_ROOT / "build" / "bin" / "kvcached")


def pool_flags(layers: int, kv_heads: int, head_dim: int, *,
               memory_bytes: int = 64 << 20, tokens_per_block: int = 16) -> List[str]:
    """The flags of a host shared-memory KV pool (float32) for the decoder's geometry."""
    return ["--backend=host", f"--pool_memory_bytes={memory_bytes}", f"--kv_layers={layers}",
            f"--kv_heads={kv_heads}", f"--kv_head_dim={head_dim}",
            f"--kv_tokens_per_block={tokens_per_block}", "--kv_dtype=float32",
            "--kv_shared_memory=true"]


def scrape(metrics_address: str) -> str:
    """One /metrics scrape (Prometheus text format)."""
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10) as reply:
        return reply.read().decode()


class Kvcached:
    """One kvcached process; a context manager (SIGTERM on exit)."""

    def __init__(self, flags: List[str], binary: Optional[str] = None) -> None:
        self.binary = kvcached_binary(binary)
        if not os.access(self.binary, os.X_OK):
            raise FileNotFoundError(
                f"kvcached is not built ({self.binary}); build it with "
                "`cmake --build build --target kvcached`, or pass --kvcached / set "
                "KVCM_KVCACHED")
        self.flags = flags
        self.workdir = Path(tempfile.mkdtemp(prefix="kvcache-eval-"))
        self.address = ""
        self.metrics_address = ""
        self.process: Optional[subprocess.Popen] = None

    def __enter__(self) -> "Kvcached":
        port_file = self.workdir / "ports.json"
        command = [str(self.binary), "--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0",
                   f"--port_file={port_file}", "--allow_shm_scores", *self.flags]
        self.log = open(self.workdir / "kvcached.log", "wb")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"kvcached exited with {self.process.returncode}: "
                                   f"{' '.join(command)}\n"
                                   + (self.workdir / "kvcached.log").read_text()[-2000:])
            try:
                ports = json.loads(port_file.read_text())
                if ports.get("grpc"):
                    self.address = ports["grpc"]
                    self.metrics_address = ports.get("metrics", "")
                    return self
            except (OSError, ValueError):
                pass
            time.sleep(0.02)
        self.process.kill()
        raise RuntimeError("kvcached wrote no port file within 30 s")

    def __exit__(self, *exc_info) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
