"""Data parallel under torchrun: the few things GRPO needs from torch.distributed, and nothing when
run alone.

    torchrun --standalone --nproc-per-node 2 trainer.py --demo  # 2 processes: gloo (CPU), NCCL

Each process (rank) takes its own slice of the step's prompts, whole groups only, and generates,
scores and back-propagates them. What must be global is made global here: the rewards (advantages
with batch-level std), the loss's normalizer (sequences, tokens or N·max_tokens over every rank),
the logged metrics, and the RNG states of a checkpoint. DistributedDataParallel averages the
gradients once per optimizer update (train.policy_update). Only rank 0 prints, writes metrics.jsonl
and writes checkpoints.
"""

import atexit
import os
import sys

import torch
import torch.distributed as dist


def init(device):
    """Join torchrun's process group when WORLD_SIZE > 1 (NCCL for CUDA, gloo for CPU) and pin
    this process's GPU; silence stdout on every rank but 0. Plain `python trainer.py`: nothing
    happens."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    # leave the group cleanly (gloo aborts at exit otherwise)
    atexit.register(dist.destroy_process_group)
    if dist.get_rank() != 0:
        sys.stdout = open(os.devnull, "w")  # one progress line per step, not one per process


class LogProbs(torch.nn.Module):
    """A log-prob function (sampling.token_logprobs) of the model as a module's forward, so that
    DistributedDataParallel sees the whole computation (the chunked lm-head included) and
    all-reduces every parameter's gradient."""

    def __init__(self, model, logprobs):
        super().__init__()
        self.model, self.logprobs = model, logprobs

    def forward(self, *args, **kwargs):
        return self.logprobs(self.model, *args, **kwargs)


def wrap(model, logprobs):
    """DistributedDataParallel around the policy's log-prob forward `logprobs(model, ...)` under
    torchrun, else None."""
    if world() == 1:
        return None
    device_ids = [torch.cuda.current_device()] if next(model.parameters()).is_cuda else None
    module = LogProbs(model, logprobs)
    return torch.nn.parallel.DistributedDataParallel(module, device_ids=device_ids)


def shard_model(model):
    """FSDP2 (torch.distributed.fsdp.fully_shard): each decoder layer (the classes transformers
    lists in _no_split_modules) its own unit, then the root (embeddings, final norm, lm-head).
    Parameters, gradients and AdamW state are then split over the ranks; each layer's weights are
    gathered for its forward and backward only."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # The mesh on the model's own device type: by default FSDP2 takes the machine's accelerator, and
    # would move a CPU model (--device cpu, gloo) onto the GPU of a GPU machine.
    mesh = init_device_mesh(next(model.parameters()).device.type, (world(),))
    layer_types = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in layer_types:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_state_dict(model):
    """Under FSDP2, the whole model's weights on rank 0 (a collective: every rank calls it; the
    others get {})."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def world():
    return dist.get_world_size() if dist.is_initialized() else 1


def launched_rank():
    """This process's rank as torchrun set it (RANK), before or after init; 0 when alone."""
    return int(os.environ.get("RANK", "0"))


def launched_world():
    """The number of processes torchrun started (WORLD_SIZE), before or after init; 1 alone."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank():
    return dist.get_rank() if dist.is_initialized() else 0


def is_main():
    return rank() == 0


def my_share(rows):
    """This rank's contiguous share of the step's rows (rank r: the r-th of world equal parts)."""
    n = len(rows) // world()
    return rows[rank() * n : (rank() + 1) * n]


def all_sum(values):
    """The sum over ranks of a list of numbers (one all-reduce): a list of floats."""
    if world() == 1:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device_of_group())
    dist.all_reduce(t)
    return t.tolist()


def gather(tensor):
    """The concatenation over ranks (in rank order) of a tensor [n, ...] whose n is the same on
    every rank."""
    if world() == 1:
        return tensor
    local = tensor.to(
        device_of_group()
    ).contiguous()  # NCCL gathers CUDA tensors only (rewards live on the CPU)
    parts = [torch.empty_like(local) for _ in range(world())]
    dist.all_gather(parts, local)
    return torch.cat(parts).to(tensor.device)


def gather_objects(obj):
    """[every rank's obj] in rank order (pickled; small things such as RNG states or evaluation
    tables)."""
    if world() == 1:
        return [obj]
    out = [None] * world()
    dist.all_gather_object(out, obj)
    return out


def barrier():
    if world() > 1:
        dist.barrier()


def device_of_group():
    return (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
