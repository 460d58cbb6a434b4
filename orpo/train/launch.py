"""Start the ranks of a distributed `orpo train`/`orpo replay`: the same command re-run as N processes.

On one host we start the processes ourselves (ring over 127.0.0.1 on CPU/Metal, NCCL on CUDA, one GPU
each): mlx.launch 0.32.4 exits 0 when a rank fails and pins rank r to GPU r whatever CUDA_VISIBLE_DEVICES
the scheduler gave, and a Snakemake rule must fail when a rank does. Across hosts (a hostfile), or for
MPI/JACCL, we hand the same command to mlx.launch and judge success by the output it must leave.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from orpo.train.distributed import BACKEND_ENV, is_launched_rank
from orpo.train.settings import DistributedSettings


def needs_launch(dist: DistributedSettings) -> bool:
    """True when the settings ask for several processes and this one is not already a rank."""
    return dist.processes > 1 and not is_launched_rank()


def resolve_backend(backend: str) -> str:
    """'any' -> nccl where CUDA is available, ring otherwise; other names unchanged."""
    if backend != "any":
        return backend
    from orpo.device import cuda_available

    return "nccl" if cuda_available() else "ring"


def free_ports(n: int) -> list[int]:
    """n TCP ports on 127.0.0.1 that were free a moment ago (held together so they differ)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def rank_envs(n: int, backend: str, workdir: Path) -> list[dict[str, str]]:
    """The environment of each local rank: who it is and how to reach the others."""
    ports = free_ports(n)
    base = {**os.environ, BACKEND_ENV: backend}
    if backend == "ring":
        hostfile = workdir / "ring_hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
        return [{**base, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile)} for r in range(n)]
    if backend == "nccl":
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(n)))).split(",") if d]
        if len(visible) < n:
            raise ValueError(f"train.distributed.processes is {n}, but only {len(visible)} GPUs are visible "
                             f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})")
        # NVLink multicast (NVLS) buys nothing for LoRA-sized all_sums and can wedge shared GPUs: off unless asked.
        common = {"NCCL_HOST_IP": "127.0.0.1", "NCCL_PORT": str(ports[0]), "MLX_WORLD_SIZE": str(n),
                  "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0")}
        return [{**base, **common, "MLX_RANK": str(r), "CUDA_VISIBLE_DEVICES": visible[r]} for r in range(n)]
    raise ValueError(f"train.distributed.backend {backend!r} on one host: use ring or nccl (or give a hostfile)")


def spawn(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    """Start one rank (stdout/stderr shared with the launcher); on Linux it dies with the launcher, even by
    SIGKILL, so no rank outlives its run and keeps writing into a folder that a restarted run resumes from."""

    def die_with_parent() -> None:
        if sys.platform.startswith("linux"):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG

    return subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent)


def wait_all(procs: list[subprocess.Popen], grace_s: float = 10.0) -> int:
    """Wait for every rank; when one fails (or we are stopped), stop the others. Returns the first failure's code."""
    def stop(*_: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                return failed[0] if failed[0] > 0 else 128 - failed[0]
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.05)
    except KeyboardInterrupt:
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        for p in procs:  # a survivor would block forever in its next all_sum
            if p.poll() is None:
                p.terminate()
        deadline = time.time() + grace_s
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def launch_hosts(argv: list[str], dist: DistributedSettings, backend: str, output: Path) -> int:
    """Run `orpo <argv>` through mlx.launch (a hostfile, or MPI/JACCL); success = `output` written after the start."""
    n = dist.processes
    launcher = shutil.which("mlx.launch", path=str(Path(sys.executable).parent)) or shutil.which("mlx.launch")
    if launcher is None:
        raise ValueError("mlx.launch not found beside this Python or on PATH (needed for train.distributed.hostfile, mpi, jaccl)")
    args = [launcher, "--backend", backend, "--cwd", os.getcwd(), "--env", f"{BACKEND_ENV}={backend}"]
    if dist.hostfile:
        hostfile = Path(dist.hostfile)
        try:
            data = json.loads(hostfile.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"train.distributed.hostfile {hostfile}: {e}") from None
        hosts = data["hosts"] if isinstance(data, dict) else data
        if len(hosts) != n:
            raise ValueError(f"train.distributed.hostfile {hostfile} lists {len(hosts)} hosts, "
                             f"but train.distributed.processes is {n}")
        args += ["--hostfile", str(hostfile)]
    else:
        args += ["--hosts", "127.0.0.1", "-n", str(n)]
    started = time.time()
    rc = subprocess.run([*args, "--", sys.executable, "-m", "orpo.cli", *argv], check=False).returncode
    if rc:
        return rc
    # mlx.launch (0.32.4) exits 0 even when a rank failed: the output rank 0 writes last is the proof.
    return 0 if output.exists() and output.stat().st_mtime >= started - 1 else 1


def launch(argv: list[str], dist: DistributedSettings, output: Path) -> int:
    """Start `orpo <argv>` as `train.distributed.processes` ranks; returns the exit code to leave with."""
    backend = resolve_backend(dist.backend)
    if dist.hostfile or backend in ("mpi", "jaccl"):
        return launch_hosts(argv, dist, backend, output)
    cmd = [sys.executable, "-m", "orpo.cli", *argv]
    with tempfile.TemporaryDirectory(prefix="orpo-ranks-") as tmp:  # ranks on this host
        envs = rank_envs(dist.processes, backend, Path(tmp))
        sys.stdout.flush()
        sys.stderr.flush()
        return wait_all([spawn(cmd, env) for env in envs])
