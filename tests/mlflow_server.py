"""A real MLflow tracking server for tests: `mlflow server` on a free port, a sqlite backend and
artifacts proxied through it (`mlflow-artifacts:/`), as a site runs one on a login node.

    with MlflowServer(tmp_path, allowed_hosts=["login"]) as server:
        server.uri("login")          # http://login:PORT, for clients that resolve `login` to this machine
        server.local_uri             # http://127.0.0.1:PORT
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from ports import listen_port


class MlflowServer:
    """Listens on every address; MLflow's Host-header check admits 127.0.0.1 and `allowed_hosts`."""

    ADMIN = ("admin", "repro-test-admin-password")  # with auth=True: the one user, created at start

    def __init__(self, root: Path, allowed_hosts: list[str] = (), auth: bool = False) -> None:
        """`auth`: MLflow's basic-auth app (`--app-name basic-auth`), as institutional servers run."""
        self.root, self.port, self.auth = Path(root), listen_port(), auth
        self.allowed = [f"{host}:{self.port}" for host in ("127.0.0.1", *allowed_hosts)]
        self.process: subprocess.Popen | None = None

    @property
    def local_uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def uri(self, host: str) -> str:
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 90) -> "MlflowServer":
        self.root.mkdir(parents=True, exist_ok=True)
        cmd = [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "0.0.0.0", "--port", str(self.port),
               "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
               "--artifacts-destination", str(self.root / "artifacts"), "--workers", "1",
               "--allowed-hosts", ",".join(self.allowed), *(["--app-name", "basic-auth"] if self.auth else [])]
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true",
               "MLFLOW_AUTH_ADMIN_PASSWORD": self.ADMIN[1], "MLFLOW_FLASK_SERVER_SECRET_KEY": "repro-tests"}
        env.pop("MLFLOW_TRACKING_URI", None)
        with open(self.root / "server.log", "wb") as log:  # (basic-auth keeps its users in the working dir)
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.root,
                                            start_new_session=True)
        deadline = time.monotonic() + timeout
        while not self._healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mlflow server did not start: {(self.root / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)
        return self

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.local_uri}/health", timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        """TERM the server's process group (uvicorn and its worker), KILL it after 20 s."""
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def __enter__(self) -> "MlflowServer":
        return self.start()

    def __exit__(self, *_exc) -> None:
        self.stop()
