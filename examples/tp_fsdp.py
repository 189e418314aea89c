# torchtitan-style training with dion3: tensor parallel on "tp", FSDP2 on "dp", DCP checkpoints.
# run:  torchrun --nproc_per_node=4 examples/tp_fsdp.py    (CPU: gloo; GPUs: NCCL, NCCL_NVLS_ENABLE=0)
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from dion3 import Dion3

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count()) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
mesh = init_device_mesh(device.type, (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp"))


class MLP(torch.nn.Module):
    def __init__(self, dim=64, hidden=256):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, hidden, bias=False)
        self.down = torch.nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


torch.manual_seed(0)  # the same initial weights on every rank
model = torch.nn.Sequential(MLP(), MLP()).to(device)
for block in model:  # tensor parallel first, then FSDP2 over the data-parallel axis
    parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(block, mesh=mesh["dp"])
fully_shard(model, mesh=mesh["dp"])

matrices = [p for p in model.parameters() if p.ndim == 2]
others = [p for p in model.parameters() if p.ndim != 2]
param_groups = [dict(params=matrices), dict(params=others, algorithm="adamw", lr=1e-3)]
# distributed_mesh=None: every parameter is a DTensor, and its own mesh and placements are read
# (up: (_StridedShard(0, sf=2), Shard(0)), down: (Shard(0), Shard(1))).
opt = Dion3(param_groups, lr=0.01, fraction=0.25, selection_scope="global")


def train(steps):
    for _ in range(steps):
        x = torch.randn(8, 64, device=device)  # the same batch on every rank (same seed)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


train(3)
if dist.get_rank() == 0:
    print("bytes sent by rank 0 in the last step:", opt.communication_bytes_by_kind)

# Checkpoint with DCP: optimizer state entries are DTensors with the parameters' placements,
# so the checkpoint loads on another layout (another dp × tp, or one process) as well.
directory = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
dist.broadcast_object_list(directory)
model_state, optim_state = get_state_dict(model, opt)
dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory[0])

model_state, optim_state = get_state_dict(model, opt)
state = {"model": model_state, "optim": optim_state}
dcp.load(state, checkpoint_id=directory[0])
set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
train(2)
if dist.get_rank() == 0:
    print("resumed from", directory[0])
dist.destroy_process_group()
