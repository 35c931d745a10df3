"""A JupyterLab server for one test module: 127.0.0.1, a free port, a token, a temporary root,
widget state saved with the notebook; stopped (with its kernels) at the end."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).parents[2]
# User settings of the test server: save widget state with the notebook, fetch no news.
SETTINGS = {
    "@jupyter-widgets/jupyterlab-manager/plugin.jupyterlab-settings": {"saveState": True},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false",
        "checkForUpdates": False,
    },
}


@dataclass
class Server:
    url: str
    token: str
    root: Path
    env: dict[str, str]

    def page_url(self, path: str) -> str:
        return f"{self.url}/lab/tree/{path}?token={self.token}&reset"

    def api(self, method: str, path: str) -> object:
        request = urllib.request.Request(
            f"{self.url}/api/{path}",
            method=method,
            headers={"Authorization": f"token {self.token}"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            body = response.read()
        return json.loads(body) if body else None


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def jupyterlab(root: Path, timeout: float = 120.0, extra: Sequence[str] = ()) -> Iterator[Server]:
    """Run ``jupyter lab`` on ``root`` (``extra``: more options) until the block ends; kernels
    import this checkout."""
    settings = root.parent / "lab-settings"
    for name, values in SETTINGS.items():
        path = settings / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    port, token = free_port(), secrets.token_hex(16)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "JUPYTER_CONFIG_DIR": str(root.parent / "jupyter-config"),
        "JUPYTER_RUNTIME_DIR": str(root.parent / "jupyter-runtime"),
    }
    command = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}",
        f"--LabApp.user_settings_dir={settings}",
        f"--LabApp.workspaces_dir={root.parent / 'lab-workspaces'}",
        "--LabApp.extension_manager=readonly",
    ]
    command.extend(extra)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        command.append("--allow-root")
    log = (root.parent / "jupyterlab.log").open("w")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    server = Server(f"http://127.0.0.1:{port}", token, root, env)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                output = (root.parent / "jupyterlab.log").read_text()[-2000:]
                raise RuntimeError(f"jupyter lab exited: {output}")
            try:
                server.api("GET", "status")
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
