"""Process groups torch can name and find: the default group, new_group, new_subgroups,
split_group, and DeviceMesh (1-D, 2-D with dim names, get_group, submeshes).

Each group made on "commlib" must carry a name registered with torch (``_resolve_process_group``
finds it: that is how DTensor's functional collectives reach it from C++) and the description
torch gave it, the same description the same construction gives on gloo; then a collective on it,
through ``dist`` and through the functional collectives (which find the group by name), must
give the closed-form result.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._C._distributed_c10d import _resolve_process_group

from tests.mpi.torch_stack.common import meshes


def _named(checker, group, what, desc=None):
    name = group.group_name
    checker.check(bool(name), f"{what}: no group name")
    checker.check(dist.distributed_c10d._world.pg_names.get(group) == name,
                  lambda: f"{what}: name {name!r} is not torch's {dist.distributed_c10d._world.pg_names.get(group)!r}")
    checker.check(_resolve_process_group(name) is group, f"{what}: _resolve_process_group({name!r}) is another group")
    if desc is not None:
        checker.check(group.group_desc == desc, lambda: f"{what}: description {group.group_desc!r}, expected {desc!r}")
    checker.check(dist.get_backend(group) == "commlib", lambda: f"{what}: backend {dist.get_backend(group)}")


def _sums(checker, group, members, what):
    """all_reduce over ``group`` (global ranks ``members``), through dist and by name."""
    mine = torch.full((3,), float(dist.get_rank() + 1))
    dist.all_reduce(mine, group=group)
    expected = float(sum(r + 1 for r in members))
    checker.equal(mine.numpy(), torch.full((3,), expected).numpy(), f"{what}: dist.all_reduce")
    by_name = funcol.all_reduce(torch.full((2,), float(dist.get_rank() + 1)), "sum", group.group_name)
    checker.equal(funcol.wait_tensor(by_name).numpy(), torch.full((2,), expected).numpy(),
                  f"{what}: functional all_reduce by group name")


def check_groups(checker):
    size, rank = dist.get_world_size(), dist.get_rank()
    world = dist.group.WORLD
    _named(checker, world, "default group", "default_pg")
    _sums(checker, world, range(size), "default group")

    everyone = dist.new_group(list(range(size)), group_desc="everyone")
    _named(checker, everyone, "new_group of all ranks", "everyone")
    _sums(checker, everyone, range(size), "new_group of all ranks")

    low = list(range(max(1, size // 2)))
    part = dist.new_group(low, group_desc="low_half")
    if rank in low:
        _named(checker, part, "new_group of the low half", "low_half")
        _sums(checker, part, low, "new_group of the low half")
    else:
        checker.check(part is dist.GroupMember.NON_GROUP_MEMBER, "a non-member got a group")

    local = dist.new_group([rank], use_local_synchronization=True, group_desc="just_me")
    _named(checker, local, "new_group with local synchronization", "just_me")

    if size % 2 == 0:
        mine, _ = dist.new_subgroups(group_size=2, group_desc="pairs")
        _named(checker, mine, "new_subgroups of pairs", "pairs")
        _sums(checker, mine, [rank - rank % 2, rank - rank % 2 + 1], "new_subgroups of pairs")
    _check_split(checker, world, size, rank)
    _check_meshes(checker, size)


def _check_split(checker, world, size, rank):
    """``ProcessGroup.split_group``, the call ``dist.split_group`` makes (torch 2.13 refuses that one
    for every backend on a host without an accelerator, before it reaches the backend)."""
    evens = [r for r in range(size) if r % 2 == 0]
    odds = [r for r in range(size) if r % 2 == 1]
    part = evens if rank % 2 == 0 else odds
    child = world.split_group(part, group_name=f"split_{rank % 2}", group_desc="parity")
    checker.check(child is not None, "split_group: no group on a member")
    if child is None:
        return
    checker.check(child.group_name == f"split_{rank % 2}" and child.group_desc == "parity",
                  lambda: f"split_group: name {child.group_name!r}, description {child.group_desc!r}")
    expected = (part.index(rank), len(part))
    checker.check((child.rank(), child.size()) == expected,
                  lambda: f"split_group: (rank, size) {(child.rank(), child.size())}, expected {expected}")
    mine = torch.full((2,), float(rank + 1))
    child.allreduce([mine]).wait()
    checker.equal(mine.numpy(), torch.full((2,), float(sum(r + 1 for r in part))).numpy(), "split_group all_reduce")
    # A rank in no part passes another part, and gets None.
    outsider = world.split_group([0], group_name="only_0", group_desc="only_0")
    checker.check((outsider is None) == (rank != 0), f"split_group of [0]: rank {rank} got {outsider!r}")


def _check_meshes(checker, size):
    flat = meshes((size,))
    checker.check(flat["commlib"].get_group() is dist.group.WORLD, "a 1-D mesh over the world is not the default group")
    _sums(checker, flat["commlib"].get_group(), range(size), "1-D mesh")
    if size % 2:
        return
    names = ("dp", "tp")
    both = meshes((2, size // 2), names)
    for dim in names:
        ours, theirs = both["commlib"].get_group(dim), both["gloo"].get_group(dim)
        if both["commlib"][dim].size() == size:  # DeviceMesh takes the default group for a dim over the world
            checker.check(ours is dist.group.WORLD, f"mesh dim {dim} over the world is not the default group")
        else:
            _named(checker, ours, f"2-D mesh dim {dim}", theirs.group_desc)
            checker.check(ours.group_desc == f"mesh_{dim}",
                          lambda dim=dim, ours=ours: f"mesh dim {dim}: description {ours.group_desc!r}")
        members = both["commlib"][dim].mesh.tolist()
        checker.check(both["commlib"][dim].get_group() is ours, f"submesh {dim}: another group")
        _sums(checker, ours, members, f"2-D mesh dim {dim}")
    flat_dp_tp = both["commlib"]["dp", "tp"]._flatten("dp_tp")
    _named(checker, flat_dp_tp.get_group(), "flattened 2-D mesh")
    _sums(checker, flat_dp_tp.get_group(), range(size), "flattened 2-D mesh")
