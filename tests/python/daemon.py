"""Starting and stopping a real kvcached for the tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import List, Optional

REPO_ROOT = Path(__file__).resolve().parents[2]


def kvcached_binary() -> Path:
    """$KVCM_KVCACHED, else build/bin/kvcached of the repository."""
    return Path(os.environ.get("KVCM_KVCACHED") or REPO_ROOT / "build" / "bin" / "kvcached")


def missing_reason() -> Optional[str]:
    """Why the daemon tests cannot run, or None when they can."""
    binary = kvcached_binary()
    if not os.access(binary, os.X_OK):
        return (f"kvcached is not built ({binary} missing; build it with "
                "`cmake --build build --target kvcached` or set KVCM_KVCACHED)")
    return None


_HELP: dict = {}


def flag_missing_reason(flag: str) -> Optional[str]:
    """Why the daemon tests that need ``--flag`` cannot run (not built, or a kvcached
    without that flag), or None when they can."""
    reason = missing_reason()
    if reason:
        return reason
    binary = kvcached_binary()
    if binary not in _HELP:
        try:
            done = subprocess.run([str(binary), "--help"], capture_output=True, text=True,
                                  timeout=30)
            _HELP[binary] = done.stdout + done.stderr
        except (OSError, subprocess.TimeoutExpired) as error:
            _HELP[binary] = f"({error})"
    if f"--{flag}" not in _HELP[binary]:
        return f"{binary} has no --{flag} (an older kvcached): rebuild it"
    return None


class Daemon:
    """One kvcached process on ephemeral loopback ports, logging into ``workdir``."""

    def __init__(self, workdir: Path, *flags: str) -> None:
        self.workdir = workdir
        self.flags = list(flags)
        self.port_file = workdir / "ports.json"
        self.log_path = workdir / "kvcached.log"
        self.process: Optional[subprocess.Popen] = None
        self.address = ""
        self.metrics_address = ""

    def start(self, timeout: float = 30.0) -> "Daemon":
        command: List[str] = [str(kvcached_binary()), "--listen=127.0.0.1:0",
                              "--metrics_listen=127.0.0.1:0", f"--port_file={self.port_file}",
                              *self.flags]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"kvcached exited with {self.process.returncode} before "
                                   f"serving: {' '.join(command)}\n{self.log()}")
            ports = self._read_ports()
            if ports is not None:
                self.address, self.metrics_address = ports["grpc"], ports.get("metrics", "")
                return self
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"kvcached wrote no port file within {timeout} s\n{self.log()}")

    def _read_ports(self) -> Optional[dict]:
        try:
            ports = json.loads(self.port_file.read_text())
        except (OSError, ValueError):  # not there yet, or half written
            return None
        return ports if isinstance(ports, dict) and ports.get("grpc") else None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def terminate(self, timeout: float = 20.0) -> int:
        """SIGTERM (drain), then the exit status; kills and raises if it does not exit."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"kvcached did not exit within {timeout} s of SIGTERM\n"
                               f"{self.log()}") from None

    def stop(self) -> None:
        """terminate(), asserting the clean exit (status 0) a drained daemon owes."""
        status = self.terminate()
        assert status == 0, f"kvcached exited with {status} after SIGTERM\n{self.log()}"

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
