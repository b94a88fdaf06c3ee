"""PyTorch's init_device_mesh layouts (tests/tp/mesh.rs): for each shape given as NAME=SIZE,NAME=SIZE...,
prints one JSON line per rank: {"shape": ..., "rank": r, "coords": [...], "groups": {name: [ranks]}}.
Each rank is simulated in this one process over the fake process group (no communication)."""
import json
import sys

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

for spec in sys.argv[1:]:
    dims = [(d.split("=")[0], int(d.split("=")[1])) for d in spec.split(",")]
    names = tuple(n for n, _ in dims)
    shape = tuple(s for _, s in dims)
    world = 1
    for s in shape:
        world *= s
    for r in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=world)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        groups = {n: dist.get_process_group_ranks(mesh.get_group(n)) for n in names}
        print(json.dumps({"shape": spec, "rank": r, "coords": list(mesh.get_coordinate()), "groups": groups}))
        dist.destroy_process_group()
