"""2-process ``torchrun`` launches of ``train.py`` runs for the tests, on the CPU (gloo): :func:`run_torchrun`.

The runs of one launch go one after another through ``tests/helpers/trainer_runs.py`` (one start-up for all), one
thread per process, with the repository root and ``tests/`` on ``PYTHONPATH`` (the test tasks of
``tests/helpers`` can be named by ``task.target=helpers.<module>.<class>``).
"""

import json
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUNS = os.path.join(ROOT, "tests", "helpers", "trainer_runs.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TIMEOUT = 600


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]),
            "WANDB_SILENT": "true"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run_torchrun(runs: list[tuple], tmp, nodes: int = 1) -> list[int]:
    """``runs`` ([(run folder or None for the default one, overrides[, interrupted])]) one after another in one
    2-process torchrun launch: one node (``--standalone``), or ``nodes=2`` launchers of one process each that meet
    at a c10d rendezvous on localhost, as two machines would. ``interrupted``: the run stops on a signal, and the
    next one goes on. Returns the launchers' pids."""
    spec = os.path.join(tmp, f"spec_{len(os.listdir(tmp))}.json")
    with open(spec, "w") as f:
        json.dump([{"dir": None if r[0] is None else str(r[0]), "overrides": r[1],
                    "interrupted": bool(r[2]) if len(r) > 2 else False} for r in runs], f)
    if nodes == 1:
        cmd = TORCHRUN + ["--standalone", "--nproc_per_node=2", RUNS, spec]
    else:
        cmd = TORCHRUN + [f"--nnodes={nodes}", "--nproc_per_node=1", "--rdzv_backend=c10d",
                          f"--rdzv_endpoint=localhost:{_free_port()}", "--rdzv_id=mhla-test", RUNS, spec]
    launchers = [subprocess.Popen(cmd, cwd=tmp, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True) for _ in range(nodes)]
    try:
        outs = [node.communicate(timeout=TIMEOUT)[0] for node in launchers]
    finally:
        for node in launchers:
            if node.poll() is None:
                node.kill()
    assert all(node.returncode == 0 for node in launchers), "\n=====\n".join(o[-4000:] for o in outs)
    return [node.pid for node in launchers]
