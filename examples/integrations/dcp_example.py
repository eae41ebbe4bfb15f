# torch.distributed.checkpoint of an FSDP2 model through warden's tier. Run it as 2 ranks under an agent:
# `warden run --nproc-per-node 2 -- python dcp_example.py` (or torchrun). A second run resumes from the tier.
# On GPUs: "nccl", and the model on torch.device("cuda", local rank) before fully_shard.
# EXAMPLE_STEPS: steps to train (default 200).
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import warden.checkpoint
from warden.integrations.dcp import WardenStorageReader, WardenStorageWriter

dist.init_process_group("gloo")  # "nccl" on GPUs
torch.manual_seed(0)  # the same initial weights on every rank
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
fully_shard(model)  # each rank keeps its shard of every parameter (DTensors)
optim = torch.optim.AdamW(model.parameters(), lr=1e-3)

start = 0
resume = warden.checkpoint.agreed_step()  # the same on every rank; None on a fresh start
if resume is not None:
    msd, osd = get_state_dict(model, optim)
    reader = WardenStorageReader(step=resume)
    dcp.load({"model": msd, "optim": osd}, storage_reader=reader)
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
    start = reader.restored_step
    print(f"rank {dist.get_rank()}: resumed from step {start}")

for step in range(start + 1, int(os.environ.get("EXAMPLE_STEPS", "200")) + 1):
    x = torch.randn(64, 32)
    loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
    loss.backward()
    optim.step()
    optim.zero_grad()
    if step % 50 == 0:  # steps are numbered from 1: 0 asks a restore for the newest
        msd, osd = get_state_dict(model, optim)
        dcp.save({"model": msd, "optim": osd}, storage_writer=WardenStorageWriter(step=step))

dist.destroy_process_group()
