"""Heal layouts: which ranks hold the same state, and who sends it to whom.

In: the declared model and optimizer, and every rank's committed step (from
``warden.heal``). For plain DDP every rank is a replica of every other. For
FSDP2 with replica groups (HSDP: ``fully_shard`` over a 2-D ``DeviceMesh``
("replicate", "shard")) the parameters are DTensors, and their mesh and
placements say which ranks hold the same local shards: those whose mesh
coordinates agree on every dimension where some parameter is sharded.
Out: the send plan (``plan``: a source for every rank that lacks the newest
step, always a rank holding the same shards; or the shard positions left
with no live replica), the local shards as plain tensors (``local_state_dict``)
and back (``load_local_state_dict``), and the FSDP2 modules bound again to
the attempt's process groups (``rebind``).
Never: sends a DTensor (a distributed object) over the wire, only its local
shard; guesses a source from another shard position; imports torch before
it is used.

Why the layout is inferred from the placements and not declared: the
placements are what ``fully_shard`` did; a declared mesh shape could
disagree with them, and a wrong plan would load one shard position's
tensors into another's parameters. The user declares the state once
(``warden.heal.declare(model, optimizer)``), and the same call serves DDP
and HSDP.

Why the model is not wrapped again after a heal: torch names the groups of a
``DeviceMesh`` from a counter that ``destroy_process_group`` resets ("to allow
consistent value to be generated when we re-create process groups after some
trainers recover from failure", torch/distributed/distributed_c10d.py), and a
mesh resolves its groups by name at each use. So the attempt that creates its
mesh again, as the first attempt did, gives the old mesh (and every DTensor
on it) the new groups. Only FSDP2 keeps the group objects themselves in each
parameter group's mesh info, computed in ``__post_init__``; ``rebind``
recomputes them and calls the public ``reset_iter_state`` on each root (the
supported recovery after an exception cut a forward or backward short). The
survivors keep their parameters, optimizer and CUDA memory: nothing is built
again or copied.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Dict, Hashable, List, Optional, Sequence, Tuple

__all__ = [
    "Layout",
    "LayoutError",
    "Plan",
    "infer",
    "load_local_state_dict",
    "load_optimizer_local_state",
    "local_state_dict",
    "optimizer_local_state",
    "plan",
    "rebind",
    "release",
]


class LayoutError(RuntimeError):
    """The declared state's layout cannot be healed as declared (says why)."""


def _torch() -> Any:
    import torch  # noqa: PLC0415 - only when used

    return torch


def _dtensor_type() -> Any:
    """DTensor, or None when its module was never imported: then no DTensor
    exists. Never imports it (4.5 s measured on the loaded 2-core machine,
    on a DDP replacement's heal path)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


@dataclass(frozen=True)
class Layout:
    """Where each rank sits in the mesh its parameters are distributed on.

    ``ranks``: the mesh's rank at each position, row-major over ``shape``.
    ``replicate_dims``: the dimensions along which every parameter is
    replicated (HSDP's "replicate"); ranks that differ only there hold the
    same local shards. ``names``: the mesh's dimension names, for messages.
    """

    shape: Tuple[int, ...]
    names: Tuple[Optional[str], ...]
    replicate_dims: Tuple[int, ...]
    ranks: Tuple[int, ...]

    def coords(self, rank: int) -> Tuple[int, ...]:
        try:
            flat = self.ranks.index(rank)
        except ValueError:
            raise LayoutError(f"rank {rank} is not in the parameters' device mesh {self.describe()}") from None
        out: List[int] = []
        for size in reversed(self.shape):
            out.append(flat % size)
            flat //= size
        return tuple(reversed(out))

    def key(self, rank: int) -> Tuple[int, ...]:
        """The shard position of ``rank``: its coordinates off the replicate dims."""
        c = self.coords(rank)
        return tuple(c[d] for d in range(len(self.shape)) if d not in self.replicate_dims)

    def describe(self) -> str:
        dims = ", ".join(
            f"{n or d}={s}{' (replicate)' if d in self.replicate_dims else ''}"
            for d, (n, s) in enumerate(zip(self.names, self.shape))
        )
        return f"mesh ({dims})"


def infer(model: Any) -> Optional[Layout]:
    """The layout of ``model``'s parameters and buffers; None when none is a
    DTensor (plain DDP: every rank holds the whole state).

    Every DTensor must live on one mesh (the job's data-parallel mesh);
    plain tensors beside them are taken as replicated on every rank.
    """
    DTensor = _dtensor_type()
    if DTensor is None:
        return None
    meshes: Dict[int, Any] = {}
    sharded_dims: set = set()
    first: Optional[str] = None
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if not isinstance(t, DTensor):
            continue
        mesh = t.device_mesh
        meshes.setdefault(id(mesh), mesh)
        if len(meshes) > 1:
            # Submeshes of one root are different objects with other shapes.
            raise LayoutError(
                f"parameters {first!r} and {name!r} are DTensors on different device meshes: "
                "warden.heal plans a heal over one mesh (the job's data-parallel mesh)"
            )
        first = first or name
        for d, p in enumerate(t.placements):
            if not p.is_replicate():
                sharded_dims.add(d)
    if not meshes:
        return None
    if _fsdp_modules(model):
        require_iter_reset(getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None))
    mesh = next(iter(meshes.values()))
    shape = tuple(int(s) for s in mesh.mesh.shape)
    names = tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else tuple(None for _ in shape)
    return Layout(
        shape=shape,
        names=names,
        replicate_dims=tuple(d for d in range(len(shape)) if d not in sharded_dims),
        ranks=tuple(int(r) for r in mesh.mesh.reshape(-1).tolist()),
    )


@dataclass(frozen=True)
class Plan:
    """Who sends what in one heal.

    ``best``: the newest committed step (-1: no rank holds one).
    ``sources``: receiver -> the rank it takes its state from.
    ``lost``: the shard positions where no rank holds the newest step (their
    state is gone: the job restores from the checkpoint instead).
    """

    best: int
    sources: Dict[int, int]
    lost: Tuple[Hashable, ...]


def plan(steps: Sequence[int], keys: Sequence[Hashable]) -> Plan:
    """The heal's plan from every rank's committed step (-1: none) and shard
    position (``keys[r]``; one key for all in plain DDP).

    Each rank not at the newest step receives from the lowest rank at that
    step with its own shard position. A pure function: a table of cases
    tests it.
    """
    if len(steps) != len(keys):
        raise ValueError(f"{len(steps)} steps for {len(keys)} ranks")
    best = max(steps, default=-1)
    if best < 0:
        return Plan(best=best, sources={}, lost=())
    holder: Dict[Hashable, int] = {}
    for r, (s, k) in enumerate(zip(steps, keys)):
        if s == best and k not in holder:
            holder[k] = r
    sources: Dict[int, int] = {}
    lost: List[Hashable] = []
    for r, (s, k) in enumerate(zip(steps, keys)):
        if s == best:
            continue
        if k in holder:
            sources[r] = holder[k]
        elif k not in lost:
            lost.append(k)
    return Plan(best=best, sources=sources, lost=tuple(lost))


# -- local shards ---------------------------------------------------------------


def _local(t: Any, DTensor: Any) -> Any:
    return t.to_local() if DTensor is not None and isinstance(t, DTensor) else t


def local_state_dict(model: Any, optimizer: Any = None) -> Dict[str, Any]:
    """The rank's state as plain tensors: every DTensor replaced by its
    local shard. ``{"model": ..., "optimizer": ..., "dtensor_state": [...]}``,
    where ``dtensor_state`` lists the optimizer entries (param index, key)
    that were DTensors, so the receiver can make them DTensors again on its
    own mesh. Safe to ``torch.save`` and to load with ``weights_only=True``.

    ``optimizer``: a torch optimizer, or an object standing for several
    (a Lightning fit's, ``warden.integrations._lightning_heal``) that has
    ``local_state_dict()`` and ``load_local_state_dict(state, marks)`` of
    its own, made with ``optimizer_local_state`` for each of its optimizers.
    """
    DTensor = _dtensor_type()
    with _torch().no_grad():
        msd = {k: _local(v, DTensor).detach() for k, v in model.state_dict().items()}
    out: Dict[str, Any] = {"model": msd, "optimizer": None, "dtensor_state": []}
    if optimizer is not None:
        several = getattr(optimizer, "local_state_dict", None)
        state, marked = several() if callable(several) else optimizer_local_state(optimizer)
        out["optimizer"] = state
        out["dtensor_state"] = marked
    return out


def optimizer_local_state(optimizer: Any) -> Tuple[Dict[str, Any], List[List[Any]]]:
    """A torch optimizer's ``state_dict`` with every DTensor entry replaced by
    its local shard, and those entries' (param index, key)."""
    DTensor = _dtensor_type()
    osd = optimizer.state_dict()
    state: Dict[Any, Any] = {}
    marked: List[List[Any]] = []
    for pid, entries in osd["state"].items():
        state[pid] = {}
        for k, v in entries.items():
            if DTensor is not None and isinstance(v, DTensor):
                marked.append([pid, k])
                v = v.to_local()
            state[pid][k] = v
    return {"state": state, "param_groups": osd["param_groups"]}, marked


def _params_in_order(optimizer: Any) -> List[Any]:
    """The optimizer's parameters in its state dict's numbering."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def load_local_state_dict(model: Any, optimizer: Any, sd: Dict[str, Any]) -> None:
    """Loads what ``local_state_dict`` made (on a rank of the same shard
    position) into ``model`` and ``optimizer`` in place: each local shard is
    copied into this rank's own parameter, and the optimizer's DTensor
    entries are made again on this rank's mesh with the placements of their
    parameter. Shapes are checked: a shard of another position is refused.
    """
    torch = _torch()
    DTensor = _dtensor_type()
    got = sd.get("model")
    if not isinstance(got, dict):
        raise LayoutError("the received state has no model")
    mine = model.state_dict(keep_vars=True)
    if set(got) != set(mine):
        extra, missing = sorted(set(got) - set(mine))[:3], sorted(set(mine) - set(got))[:3]
        raise LayoutError(f"the received model state differs in its keys (extra {extra}, missing {missing})")
    with torch.no_grad():
        for k, t in mine.items():
            local = _local(t, DTensor)
            src = got[k]
            if tuple(src.shape) != tuple(local.shape) or src.dtype != local.dtype:
                raise LayoutError(
                    f"{k}: received a {src.dtype} shard of {tuple(src.shape)}, this rank holds "
                    f"{local.dtype} {tuple(local.shape)}: not the same shard position"
                )
            local.copy_(src)
    osd = sd.get("optimizer")
    if optimizer is None or osd is None:
        return
    marks = sd.get("dtensor_state", [])
    several = getattr(optimizer, "load_local_state_dict", None)
    if callable(several):
        several(osd, marks)
    else:
        load_optimizer_local_state(optimizer, osd, marks)


def load_optimizer_local_state(optimizer: Any, osd: Dict[str, Any], marks: Sequence[Sequence[Any]]) -> None:
    """Loads what ``optimizer_local_state`` made into ``optimizer``: each
    marked entry made a DTensor again on this rank's mesh with the
    placements of its parameter (shapes checked)."""
    DTensor = _dtensor_type()
    params = _params_in_order(optimizer)
    for mark in marks:
        if not isinstance(mark, (list, tuple)) or len(mark) != 2:
            raise LayoutError(f"optimizer state mark {mark!r}: not (param index, key)")
        pid, k = mark
        if not isinstance(pid, int) or not 0 <= pid < len(params):
            raise LayoutError(f"optimizer state for parameter {pid!r}: this optimizer has {len(params)}")
        p = params[pid]
        v = osd["state"][pid][k]
        if DTensor is None or not isinstance(p, DTensor):
            raise LayoutError(f"optimizer state {pid}.{k} was a DTensor, its parameter here is not")
        if tuple(v.shape) != tuple(p.to_local().shape):
            raise LayoutError(
                f"optimizer state {pid}.{k}: a shard of {tuple(v.shape)} for a parameter shard of "
                f"{tuple(p.to_local().shape)}: only state shaped like its parameter is supported"
            )
        osd["state"][pid][k] = DTensor.from_local(
            v, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )
    optimizer.load_state_dict(osd)


# -- the attempt's process groups -------------------------------------------------


def require_iter_reset(fsdp_module: Any) -> None:
    """Raises LayoutError where FSDP2 has no ``reset_iter_state``.

    Why: a heal restarts the survivors in process, cut in the middle of an
    iteration, and FSDP2's iteration state must be cleared before the next
    forward; torch 2.15 made that public (``FSDPModule.reset_iter_state``).
    Seen on torch 2.11 (a GPU machine's, 2026-11-28): every survivor failed
    in its heal with AttributeError. Said at ``declare``, before the job
    runs, rather than at the first fault."""
    if fsdp_module is not None and not hasattr(fsdp_module, "reset_iter_state"):
        version = getattr(sys.modules.get("torch"), "__version__", "?")
        raise LayoutError(
            f"warden.heal: healing an FSDP2 model needs torch 2.15 or newer (FSDPModule.reset_iter_state, "
            f"to clear the iteration a fault cut short); this is torch {version}. Upgrade torch, or declare "
            "no state and restore from the checkpoint (warden.checkpoint) after a fault"
        )


def _fsdp_modules(model: Any) -> List[Any]:
    """The model's FSDP2 modules (none when FSDP was never imported)."""
    FSDPModule = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    if FSDPModule is None:
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _meshes(model: Any) -> List[Any]:
    """The meshes of ``model``'s DTensors and their root meshes, once each."""
    DTensor = _dtensor_type()
    if DTensor is None:
        return []
    found: Dict[int, Any] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if isinstance(t, DTensor):
            mesh = t.device_mesh
            for m in (mesh, mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else None):
                if m is not None:
                    found.setdefault(id(m), m)
    return list(found.values())


def _check_mesh(layout: Layout, model: Any, rank: int) -> None:
    """Each of the mesh's groups resolves to a live group of this attempt with
    the ranks it had: the attempt made the mesh again, the same way."""
    torch = _torch()
    dist = torch.distributed
    DTensor = _dtensor_type()
    mesh = next(
        (t.device_mesh for t in list(model.parameters()) + list(model.buffers()) if isinstance(t, DTensor)),
        None,
    )
    if mesh is None:
        return
    coords = layout.coords(rank)
    grid = mesh.mesh
    for d in range(len(layout.shape)):
        index: List[Any] = list(coords)
        index[d] = slice(None)
        want = [int(r) for r in grid[tuple(index)].reshape(-1).tolist()]
        try:
            group = mesh.get_group(d)
            have = [int(r) for r in dist.get_process_group_ranks(group)]
        except Exception as e:  # noqa: BLE001 - any failure is the same advice
            raise LayoutError(
                f"the {layout.describe()} has no live group for dimension {layout.names[d] or d} ({e}): "
                "create the device mesh in every attempt, after warden.heal.init_process_group and "
                "before resume, with the same calls as in the first attempt"
            ) from None
        if have != want:
            raise LayoutError(
                f"dimension {layout.names[d] or d} of the {layout.describe()} resolves to a group of ranks "
                f"{have}, not {want}: this attempt made its groups in another order than the first"
            )


def rebind(model: Any, layout: Optional[Layout], rank: int) -> int:
    """Binds ``model``'s FSDP2 modules to this attempt's process groups and
    clears an iteration a restart cut short. Returns how many modules were
    rebound (0 for a model without FSDP2)."""
    if layout is None:
        return 0
    _check_mesh(layout, model, rank)
    from torch.distributed.distributed_c10d import _resolve_process_group  # noqa: PLC0415

    for mesh in _meshes(model):
        registry = getattr(mesh, "_pg_registry", None)
        if isinstance(registry, dict) and mesh._get_root_mesh() is mesh:
            for name in getattr(mesh, "_dim_group_names", []):
                registry[name] = _resolve_process_group(name)
    modules = _fsdp_modules(model)
    for m in modules:
        state = m._get_fsdp_state()
        if state._is_root:
            # Public (torch 2.15): reshards, clears the cut iteration's
            # trackers and gradients.
            m.reset_iter_state()
    for m in modules:
        state = m._get_fsdp_state()
        for group in getattr(state, "_fsdp_param_groups", []):
            infos = {id(i): i for i in (group.mesh_info, group.post_forward_mesh_info) if i is not None}
            for info in infos.values():
                # Recomputes the cached group objects (shard, replicate)
                # from the mesh, which now resolves to the new groups.
                info.__post_init__()
    return len(modules)


#: The mesh-info attributes where FSDP2 keeps group objects (torch 2.15).
_GROUP_ATTRS = ("shard_process_group", "replicate_process_group", "reduce_scatter_process_group")


def release(model: Any) -> int:
    """Drops FSDP2's references to the attempt's aborted groups, and to the
    results of their collectives in flight, at once.

    Why: a gloo group closes its sockets only when its last reference goes,
    and a peer blocked in a collective with this rank (one no abort wakes)
    waits on them. FSDP2 keeps the shard and replicate groups in each
    parameter group's mesh info: until ``rebind`` replaced them, the rank of
    the other replica group beside the lost one stayed blocked until it
    left by itself (``warden.heal``'s exit 75), in every one of 5 runs of the
    4-rank example before this. ``warden.heal.init_process_group`` calls it
    on every declared state before the ranks meet; ``rebind`` puts the new
    groups in. Never waits on a collective of the aborted group. Returns
    how many FSDP2 modules it went through.
    """
    for mesh in _meshes(model):
        # Its registry of groups (for torch.compile's tracing) holds them too.
        registry = getattr(mesh, "_pg_registry", None)
        if isinstance(registry, dict):
            registry.clear()
    modules = _fsdp_modules(model)
    for m in modules:
        state = m._get_fsdp_state()
        ctx = getattr(state, "_comm_ctx", None)
        if ctx is not None and hasattr(ctx, "all_gather_state"):
            ctx.all_gather_state = None
        for group in getattr(state, "_fsdp_param_groups", []):
            for attr in ("_all_gather_result", "_all_reduce_state"):
                if hasattr(group, attr):
                    setattr(group, attr, None)
            for info in (group.mesh_info, group.post_forward_mesh_info):
                for attr in _GROUP_ATTRS:
                    if info is not None and hasattr(info, attr):
                        setattr(info, attr, None)
    return len(modules)
