"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for the trainer: ``trainer.strategy=fsdp`` under ``torchrun``.

Sharding: :func:`shard_model` applies ``fully_shard`` to each of the model's transformer blocks
(:func:`shard_units`), then to the model itself (the root: the embeddings, heads and everything outside the
blocks). Every parameter becomes a ``DTensor`` sharded on its first dimension across the ranks; the model keeps its
class, its parameter names and their order, so the optimizer groups, the modules' hooks and the EMA see the same
names as in a single-process run. The rule for the blocks, in order:

1. the classes named in ``_no_split_modules`` (the transformers / diffusers convention: ``WanTransformerBlock``,
   ``MHLALMBlock``, ``LlamaDecoderLayer``, ...) of the model or any of its modules;
2. else the children of each ``nn.ModuleList`` / ``nn.Sequential`` that holds two or more modules of one class,
   each with submodules of its own (``blocks``, ``layers``, the stages of a hierarchical model): the repeated
   blocks, not a ``Sequential(Linear, GELU, Linear)``;

only the outermost of them (a block inside a block is not sharded on its own); a model with none is sharded as one
unit (the root).

Mixed precision (:func:`mixed_precision`): with ``trainer.precision`` bf16 / fp16, parameters are all-gathered and
used in that dtype, gradients are reduced in fp32, and the sharded parameters and the optimizer stay fp32; the
trainer's autocast stays on as with DDP. Inputs are not cast (``cast_forward_inputs=False``): timesteps and
rotary tables stay fp32, as under DDP's autocast.

Evaluation and ``after_fit``: :func:`gathered` all-gathers the parameters of the model (and the EMA) for the
duration: the forward passes inside then need no communication, so ranks may run different numbers of them
(uneven evaluation shards, ``model.generate`` on rank 0 alone), and the modules' ``logged_matrices`` see whole
matrices. It costs one unsharded copy of the weights (in the compute dtype) per rank while it lasts.

Checkpoints (:func:`full_model_state`, :func:`full_optimizer_state`, :func:`load_optimizer_state`): the trainer
saves the same ``last.pt`` / ``best.pt`` as with DDP: full (unsharded) model, EMA and optimizer states, gathered
to rank 0's CPU memory with ``torch.distributed.checkpoint.state_dict`` (``get_model_state_dict`` /
``get_optimizer_state_dict``, ``full_state_dict=True, cpu_offload=True``), the optimizer state keyed by parameter
index as ``optimizer.state_dict()`` keys it. A resume loads the model and EMA weights into the model before it is
sharded and the optimizer with ``set_optimizer_state_dict`` (``broadcast_from_rank0=True``). So ``eval.py`` and
every script that reads a checkpoint read an FSDP run's as any other, and a run may resume under either strategy.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
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
    docstring (``_no_split_modules`` classes, else the repeated blocks of a ModuleList / Sequential), outermost
    only, in the order of ``model.modules()``; those without parameters are left to the root."""
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
                if len(kids) >= 2 and len({type(k) for k in kids}) == 1 and any(True for _ in kids[0].children()):
                    candidates.extend(kids)
    units, covered = [], set()
    for m in candidates:
        if id(m) in covered or not any(True for _ in m.parameters()):
            continue
        units.append(m)
        covered.update(id(sub) for sub in m.modules())
    return units


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """``fp32``: none; ``bf16`` / ``fp16``: parameters all-gathered and computed in that dtype, gradients reduced
    in fp32, inputs left as they are (the trainer's autocast casts what it casts under DDP)."""
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


def is_sharded(module: nn.Module | None) -> bool:
    return isinstance(module, FSDPModule)


def _fsdp_modules(*modules: nn.Module | None) -> list[FSDPModule]:
    return [m for module in modules if module is not None for m in module.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered(*modules: nn.Module | None):
    """Within the block, the parameters of the FSDP ``modules`` are whole (plain tensors, all-gathered once) and
    stay so through forward passes, which then communicate nothing; every rank must enter it. A no-op for
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


def full_tensor(t: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor's whole value (a collective: every rank calls it); other tensors as they are."""
    return t.full_tensor() if isinstance(t, DTensor) else t


_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_model_state(module: nn.Module) -> dict:
    """``module.state_dict()`` with whole tensors on the CPU, on rank 0 ({} on the others); a collective."""
    return get_model_state_dict(module, options=_FULL)


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of the optimizer's parameters in its order (the index ``optimizer.state_dict()`` keys by)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` as a single process has it (keyed by parameter index, whole tensors on the CPU),
    on rank 0 ({} on the others); a collective."""
    state = get_optimizer_state_dict(model, optimizer, options=_FULL)
    if not state:
        return {}
    index = {name: i for i, name in enumerate(_param_names(model, optimizer))}
    return {"state": dict(sorted((index[name], s) for name, s in state["state"].items())),
            "param_groups": [{**g, "params": [index[name] for name in g["params"]]} for g in state["param_groups"]]}


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict, rank: int) -> None:
    """Load an ``optimizer.state_dict()`` (keyed by parameter index, whole tensors) into the optimizer of the
    sharded ``model``; a collective. Rank 0's tensors are broadcast and each rank keeps its shard; the groups'
    settings are taken from every rank's ``state`` as saved (as ``optimizer.load_state_dict`` takes them: the
    broadcast would turn the tuple ``betas`` into a list, and the next checkpoint would differ)."""
    names = _param_names(model, optimizer)
    by_name = {}
    if rank == 0:
        by_name = {"state": {names[i]: s for i, s in state["state"].items()},
                   "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, by_name,
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for group, saved in zip(optimizer.param_groups, state["param_groups"], strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})
