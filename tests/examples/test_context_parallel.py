"""examples/context_parallel.py: under torchrun, each step's loss equals the one-process loss to 1e-5;
with --quick and no torchrun, it starts its processes itself."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "context_parallel.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_losses_match_one_process_under_torchrun():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=3", f"--master_port={_free_port()}",
           str(EXAMPLE), "--seq-len", "193", "--steps", "2", "--layers", "1"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    steps = re.findall(r"step \d: loss ([\d.]+) \(3 processes\)\s+([\d.]+) \(one process\)", run.stdout)
    assert len(steps) == 2, run.stdout
    for distributed, single in steps:
        assert abs(float(distributed) - float(single)) <= 1e-5


def test_quick_without_torchrun_starts_two_processes():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    run = subprocess.run([sys.executable, str(EXAMPLE), "--quick"], env=env, capture_output=True, text=True,
                         timeout=180)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "starting 2 processes" in run.stdout
    steps = re.findall(r"step \d: loss ([\d.]+) \(2 processes\)\s+([\d.]+) \(one process\)", run.stdout)
    assert len(steps) == 2 and all(abs(float(a) - float(b)) <= 1e-5 for a, b in steps), run.stdout
