import multiprocessing
import os
import signal
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# train.py and eval.py are top-level files, not a package: the repository root on sys.path imports them (and the
# packages of this checkout: mhla, models, tasks, scripts). Scripts are imported through their package
# (``from scripts import bench_ops``, ``from scripts.tables import registry``), never from scripts/ itself.
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Keep CPU tests reproducible and fast on a 2-core machine: two threads in one process, one per process when
# pytest-xdist runs the files in parallel (``make test``: two workers, ``TEST_JOBS`` in the Makefile).
_XDIST = "PYTEST_XDIST_WORKER" in os.environ
torch.set_num_threads(1 if _XDIST else max(1, min(2, os.cpu_count() or 1)))

# Without a GPU the Triton kernels are tested in Triton's CPU interpreter. Triton reads TRITON_INTERPRET when a
# function is decorated with @triton.jit, and that includes triton.language's own helpers (tl.zeros, tl.cdiv),
# which are decorated when triton is first imported. Other test modules import triton indirectly (diffusers,
# transformers), so the variable must be set before any of them is collected: here, before everything else.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_sessionfinish(session, exitstatus):
    """Child processes still alive when the tests end fail the run, and are killed. ``multiprocessing``'s exit
    hook waits for its children, so a worker that ignores SIGTERM (the trainer's loader workers do) would
    otherwise hang the interpreter after the last test, until CI's time limit."""
    left = [p for p in multiprocessing.active_children() if p.is_alive()]
    if not left:
        return
    names = ", ".join(f"{p.name} (pid {p.pid})" for p in left)
    session.config.get_terminal_writer().line(f"ERROR: child processes outlived the tests: {names}; killed")
    for p in left:
        os.kill(p.pid, signal.SIGKILL)
        p.join()
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(0)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny models: ~50x faster than two when another process shares the
    2 CPU cores. Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def trainer_loaders(monkeypatch):
    """The DataLoaders the shared trainer builds during the test, in order (a spy on ``Trainer._loader``)."""
    from tasks.common.trainer import Trainer  # noqa: PLC0415

    loaders = []
    make = Trainer._loader

    def spy(self, *args, **kwargs):
        loaders.append(make(self, *args, **kwargs))
        return loaders[-1]

    monkeypatch.setattr(Trainer, "_loader", spy)
    return loaders
