"""torch.distributed.checkpoint of FSDP2 model and optimizer state on the backend.

At every world size: a model trained on one backend is saved (``dcp.save`` over that backend's
group), loaded into a fresh model sharded on the other backend (``dcp.load`` over the other's
group), and its parameters and Adam state must be the saved ones, bit for bit: commlib's files
load on gloo and gloo's on commlib. ``--save-for-resharding`` (the P=4 job) also keeps the
commlib checkpoint with a reference copy of its whole state; ``--load-resharded`` (the P=2 job)
loads that checkpoint, written by 4 ranks, into 2-rank shardings on both backends.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from tests.mpi.torch_stack.common import full, grid_mlp, meshes, same_state
from tests.mpi.torch_stack.fsdp import shard_and_train

_RESHARD = "written_by_4_ranks"


def _fresh(mesh):
    model = grid_mlp(seed=1)  # other initial values than the saved model's
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _load(path, mesh):
    model, optimizer = _fresh(mesh)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optimizer_state}
    dcp.load(state, checkpoint_id=path, process_group=mesh.get_group())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return get_state_dict(model, optimizer)


def _whole(state):
    """Every tensor of a (nested) state dict as its full value (collective over its mesh)."""
    if isinstance(state, dict):
        return {key: _whole(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_whole(value) for value in state)
    return full(state).detach().clone() if isinstance(state, torch.Tensor) else state


def check_checkpoint(checker, args):
    size = dist.get_world_size()
    flat = meshes((size,))
    for writer, reader in (("commlib", "gloo"), ("gloo", "commlib")):
        model, optimizer = shard_and_train(flat[writer], {})
        saved = get_state_dict(model, optimizer)
        path = os.path.join(args.checkpoints, f"p{size}_{writer}")
        dcp.save({"model": saved[0], "optim": saved[1]}, checkpoint_id=path, process_group=flat[writer].get_group())
        loaded = _load(path, flat[reader])
        same_state(checker, loaded[0], saved[0], f"DCP written on {writer}, loaded on {reader}: model")
        same_state(checker, loaded[1], saved[1], f"DCP written on {writer}, loaded on {reader}: Adam state")
        if args.save_for_resharding and writer == "commlib":
            _keep_for_resharding(args.checkpoints, model, optimizer, flat[writer])
    if args.load_resharded:
        reference = torch.load(os.path.join(args.checkpoints, f"{_RESHARD}.pt"), weights_only=False)
        for reader, mesh in flat.items():
            loaded = _whole(_load(os.path.join(args.checkpoints, _RESHARD), mesh))
            what = f"DCP of 4 ranks loaded on {size} ({reader})"
            same_state(checker, loaded[0], reference["model"], f"{what}: model")
            same_state(checker, loaded[1], reference["optim"], f"{what}: Adam state")


def _keep_for_resharding(directory, model, optimizer, mesh):
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optimizer_state}, checkpoint_id=os.path.join(directory, _RESHARD),
             process_group=mesh.get_group())
    whole = {"model": _whole(model_state), "optim": _whole(optimizer_state)}
    if dist.get_rank() == 0:
        torch.save(whole, os.path.join(directory, f"{_RESHARD}.pt"))
    dist.barrier()
