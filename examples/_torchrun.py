"""The examples' launcher: run by itself, an example starts its ranks with torchrun.

Not part of dtprofile: the examples import it from beside them (``python
examples/<name>.py`` puts this folder on ``sys.path``). In a script of your own,
launch with ``torchrun`` or ``accelerate launch`` instead.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys


def relaunch(script: str, argv: list[str], processes: int = 2) -> int:
    """``script`` again under torchrun, ``processes`` local ranks on a free loopback port;
    its exit status."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={processes}",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        os.path.abspath(script),
        *argv,
    ]
    return subprocess.call(command, env={**os.environ, "OMP_NUM_THREADS": "1"})
