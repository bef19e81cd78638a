"""Data parallel under torchrun: the few things GRPO needs from torch.distributed, and nothing when
run alone.

    torchrun --standalone --nproc-per-node 2 trainer.py --demo  # 2 processes: gloo (CPU), NCCL

Each process (rank) takes its own slice of the step's prompts, whole groups only, and generates,
scores and back-propagates them. What must be global is made global here: the rewards (advantages
with batch-level std), the loss's normalizer (sequences, tokens or N·max_tokens over every rank),
the logged metrics, and the RNG states of a checkpoint. DistributedDataParallel averages the
gradients once per optimizer update (train.policy_update). Only rank 0 prints, writes metrics.jsonl
and writes checkpoints (under FSDP2 each rank also writes its shards of AdamW's state into them).
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


def save_sharded_optimizer(model, optimizer, directory):
    """Under FSDP2, AdamW's state as the ranks hold it, each its own shards of the moments, written
    into `directory` by torch.distributed.checkpoint (DCP): a file per rank and the .metadata that
    maps them (rank 0 writes it after every rank has written and fsynced its file). A collective:
    every rank calls it. Keys are the parameters' names, not their order. Before the first update
    AdamW has no state, and only its param_groups are written: get_optimizer_state_dict would make
    the state first (a step at learning rate 0 that counts 1), and the run would go on from it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if optimizer.state:
        state = get_optimizer_state_dict(model, optimizer)
    else:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        state = {"param_groups": groups}
    dcp.save({"optimizer": state}, checkpoint_id=directory)


def load_sharded_optimizer(model, optimizer, directory):
    """AdamW's state from save_sharded_optimizer's `directory` into `optimizer` (a collective).
    DCP reads into tensors laid out as this run shards them: get_optimizer_state_dict makes them
    (on a fresh optimizer, by one step at learning rate 0 with zero gradients, which leaves the
    weights unchanged bit for bit), dcp.load fills them, set_optimizer_state_dict puts them in
    place with the saved step counts and param_groups. Only the entries the checkpoint holds are
    asked for and put back: a checkpoint saved before the first update holds none, a parameter
    that never had a gradient has none, and such a parameter starts without AdamW state, as it
    would have in the run never stopped."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    saved = set(dcp.FileSystemReader(directory).read_metadata().state_dict_metadata)
    if not any(k.startswith("optimizer.state.") for k in saved):
        # saved before the first update: no state, as in this fresh optimizer (whose param_groups
        # are the run's; the schedule sets their learning rates)
        return
    # get_optimizer_state_dict makes AdamW's state only where no parameter holds a gradient (else
    # it returns it empty, and nothing would load); none is needed before the first update
    optimizer.zero_grad(set_to_none=True)
    template = get_optimizer_state_dict(model, optimizer)
    kept = {
        name: {k: v for k, v in entries.items() if f"optimizer.state.{name}.{k}" in saved}
        for name, entries in template["state"].items()
    }
    template["state"] = {name: entries for name, entries in kept.items() if entries}
    state = {"optimizer": template}
    dcp.load(state, checkpoint_id=directory)
    # strict=False: a parameter the checkpoint holds no state for is left without (not refused)
    options = StateDictOptions(strict=False)
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)


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
