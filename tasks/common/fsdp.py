"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for the trainer: ``trainer.strategy=fsdp`` under
``torchrun``.

Sharding: :func:`shard_model` applies ``fully_shard`` to each of the model's transformer blocks
(:func:`shard_units`), then to the model itself (the root: the embeddings, heads and everything outside the
blocks). Every parameter becomes a ``DTensor`` sharded on its first dimension across the ranks; the model
keeps its class, its parameter names and their order, so the optimizer groups, the modules' hooks and the EMA
see the same names as in a single-process run. The rule for the blocks, in order:

1. the classes named in ``_no_split_modules`` (the transformers / diffusers convention:
   ``WanTransformerBlock``, ``MHLALMBlock``, ``LlamaDecoderLayer``, ...) of the model or any of its modules;
2. else the children of each ``nn.ModuleList`` / ``nn.Sequential`` that holds two or more modules of one
   class, each with submodules of its own (``blocks``, ``layers``, the stages of a hierarchical model): the
   repeated blocks, not a ``Sequential(Linear, GELU, Linear)``;

only the outermost of them (a block inside a block is not sharded on its own); a model with none is sharded as
one unit (the root).

Mixed precision (:func:`mixed_precision`): with ``trainer.precision`` bf16 / fp16, parameters are all-gathered
and used in that dtype, gradients are reduced in fp32, and the sharded parameters and the optimizer stay fp32;
the trainer's autocast stays on as with DDP. Inputs are not cast (``cast_forward_inputs=False``): timesteps
and rotary tables stay fp32, as under DDP's autocast.

Gradient accumulation: the trainer runs the micro-batches of an optimizer step before its last inside
:func:`no_gradient_sync` (no reduce-scatter: each rank sums its unsharded gradients), and the last one's backward
reduce-scatters the sum.

Evaluation and ``after_fit``: :func:`gathered` all-gathers the parameters of the model (and the EMA) for the
duration: the forward passes inside then need no communication, so ranks may run different numbers of them
(uneven evaluation shards, ``model.generate`` on rank 0 alone), and the modules' ``logged_matrices`` see whole
matrices. It costs one unsharded copy of the weights (in the compute dtype) per rank while it lasts.

Checkpoints (:func:`sharded_state`, :func:`load_sharded`): with ``torch.distributed.checkpoint`` (DCP). Each
rank writes its own shards of the model, optimizer and EMA to the run's ``checkpoints/last.dcp/`` folder
(:meth:`tasks.common.checkpoint.CheckpointManager.save_sharded`): nothing is gathered, no rank holds more than
its shard. A resume builds the same sharded state dicts on the sharded model and loads them in place
(``dcp.load``, then ``set_model_state_dict`` / ``set_optimizer_state_dict``); DCP re-shards on load, so a run
may resume on another number of processes. On one process, :func:`tasks.common.checkpoint.load_checkpoint`
reads the folder as whole tensors in a single process's layout, so ``eval.py``, the scripts and a DDP resume
read it as a ``last.pt``. The other way, an FSDP run resumed from a ``.pt`` loads the whole weights into the
model before it is sharded and the optimizer state from rank 0 (:func:`load_optimizer_state`).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

#: the reshard-after-forward setting each FSDP module was given, restored after :func:`gathered`
_RESHARD_ATTR = "_mhla_reshard_after_forward"


def device_mesh(device: torch.device, world_size: int) -> DeviceMesh:
    """A 1-D mesh of all ranks on ``device``'s type (CUDA: each rank's current device)."""
    return init_device_mesh(device.type, (world_size,))


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules :func:`shard_model` shards on their own: the model's blocks, by the rule in the module
    docstring (``_no_split_modules`` classes, else the repeated blocks of a ModuleList / Sequential),
    outermost only, in the order of ``model.modules()``; those without parameters are left to the root."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    if names:
        candidates = [m for m in model.modules() if m is not model and type(m).__name__ in names]
    else:
        candidates = []
        for m in model.modules():
            if isinstance(m, (nn.ModuleList, nn.Sequential)):
                kids = list(m.children())
                repeated = len(kids) >= 2 and len({type(k) for k in kids}) == 1
                if repeated and any(True for _ in kids[0].children()):
                    candidates.extend(kids)
    units, covered = [], set()
    for m in candidates:
        if id(m) in covered or not any(True for _ in m.parameters()):
            continue
        units.append(m)
        covered.update(id(sub) for sub in m.modules())
    return units


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """``fp32``: none; ``bf16`` / ``fp16``: parameters all-gathered and computed in that dtype, gradients
    reduced in fp32, inputs left as they are (the trainer's autocast casts what it casts under DDP)."""
    if precision == "fp32":
        return MixedPrecisionPolicy(cast_forward_inputs=False)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)


def shard_model(model: nn.Module, mesh: DeviceMesh, precision: str = "fp32") -> str:
    """``fully_shard`` each of :func:`shard_units` (resharded after their forward), then ``model`` (kept
    gathered from its forward to its backward, which needs it first), in place; returns what it sharded, in
    words ("12 blocks (Block), then the rest of the model")."""
    mp = mixed_precision(precision)
    units = shard_units(model)
    classes = sorted({type(u).__name__ for u in units})
    words = (f"{len(units)} blocks ({', '.join(classes)}), then the rest of the model" if units
             else "the model as one unit (no blocks found)")
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
        setattr(unit, _RESHARD_ATTR, True)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    setattr(model, _RESHARD_ATTR, False)
    return words


def _fsdp_modules(*modules: nn.Module | None) -> list[FSDPModule]:
    return [m for module in modules if module is not None
            for m in module.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered(*modules: nn.Module | None):
    """Within the block, the parameters of the FSDP ``modules`` are whole (plain tensors, all-gathered once)
    and stay so through forward passes, which then communicate nothing; every rank must enter it. A no-op for
    modules that are not sharded (DDP, one process)."""
    units = _fsdp_modules(*modules)
    if not units:
        yield
        return
    for m in units:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in units:
            m.reshard()
            m.set_reshard_after_forward(getattr(m, _RESHARD_ATTR, True), recurse=False)


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module):
    """Within the block, the backward of the sharded ``model`` sums each rank's gradients unsharded, without the
    reduce-scatter: the micro-batches of an accumulated optimizer step before its last, whose backward (outside
    the block) then reduce-scatters the sum (FSDP2's ``set_requires_gradient_sync``; DDP's ``no_sync``)."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def full_tensor(t: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor's whole value (a collective: every rank calls it); other tensors as they are."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer, ema_module: nn.Module | None) -> dict:
    """What DCP saves of a sharded run: ``model`` and ``ema`` (the EMA's module) state dicts and the
    optimizer's (keyed by parameter name), their tensors this rank's shards (DTensors). Builds the optimizer's
    state (zeros) if it has none yet, as a load target needs it."""
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    if ema_module is not None:
        state["ema"] = get_model_state_dict(ema_module)
    return state


def load_sharded(path, model: nn.Module, optimizer: torch.optim.Optimizer,
                 ema_module: nn.Module | None) -> None:
    """Load a DCP checkpoint folder (:meth:`~tasks.common.checkpoint.CheckpointManager.save_sharded`) into the
    sharded ``model``, ``optimizer`` and EMA module, each rank reading the pieces of its shards; a
    collective."""
    state = sharded_state(model, optimizer, ema_module)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    if ema_module is not None:
        set_model_state_dict(ema_module, state["ema"])


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of the optimizer's parameters in its order (the index ``optimizer.state_dict()`` keys by)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict, rank: int) -> None:
    """Load an ``optimizer.state_dict()`` (keyed by parameter index, whole tensors) into the optimizer of the
    sharded ``model``; a collective. Rank 0's tensors are broadcast and each rank keeps its shard; the groups'
    settings are taken from every rank's ``state`` as saved (as ``optimizer.load_state_dict`` takes them: the
    broadcast would turn the tuple ``betas`` into a list, and the next checkpoint would differ)."""
    names = _param_names(model, optimizer)
    by_name = {}
    if rank == 0:
        by_name = {"state": {names[i]: s for i, s in state["state"].items()},
                   "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                                    for g in state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, by_name,
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for group, saved in zip(optimizer.param_groups, state["param_groups"], strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})
