"""Checkpoints: saving a run, finding the last whole checkpoint, and restoring a run from it.

OUTPUT_DIR/checkpoint holds save_pretrained's model and tokenizer (AutoModelForCausalLM loads it)
and training_state.pt: AdamW, the LR schedule (and fp16's loss scaler), the step, the RNG states
and the flags. Under --fsdp the weights are gathered whole onto rank 0 as ever, and AdamW's
sharded state goes beside them into checkpoint/optimizer, each rank its own file, with
torch.distributed.checkpoint (save_sharded, restore_sharded). It is written into checkpoint.tmp,
fsynced and renamed into place, after checking that the weights are finite. A run's data position
needs no saving: the batch of step s is a pure function of the seed and s (data.batch_at); its
evaluations are read back from metrics.jsonl. The output directory itself (one run in it, its
lock) is rundir.py's.
"""

import json
import math
import os
import random
import shutil
import sys
import time
import zipfile

import numpy as np
import torch
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForCausalLM

from support import distributed
from support.errors import NonFiniteWeights, SaveFailed, UserError, WriteFailed, failure

# Which weights π_θ starts from (starting_weights): decided once, at startup.
FROM_MODEL = "model"  # π_θinit: --model (or the demo's model); a fresh run
FROM_CHECKPOINT = "checkpoint"  # the checkpoint's whole model, loaded in --model's place
# --model first (π_ref needs π_θinit, or the demo builds its model in code), then the
# checkpoint's weights for π_θ
MODEL_THEN_CHECKPOINT = "model, then the checkpoint's weights"
MODEL_AND_ADAPTER = "model with the checkpoint's LoRA adapter"


def starting_weights(args, resume_dir):
    """Where π_θ's weights come from: a fresh run starts from --model (FROM_MODEL); --resume (and
    --eval-only --resume) from the checkpoint: the adapter on --model with LoRA, --model and then
    the checkpoint's weights when π_ref needs --model's (β > 0 in training) or the demo builds
    its model in code, else the checkpoint's model alone."""
    if resume_dir is None:
        return FROM_MODEL
    if args.lora_rank:
        return MODEL_AND_ADAPTER
    if args.demo or (args.beta > 0 and not args.eval_only):
        return MODEL_THEN_CHECKPOINT
    return FROM_CHECKPOINT


def save_merged(model, peft_model, directory):
    """The merged model (merged_state_dict) as an ordinary save_pretrained directory. An adapter
    on a tied lm-head (or input embedding) makes the two differ: the saved config then unties
    them, or loading would re-tie them."""
    state = merged_state_dict(peft_model)
    tied = getattr(model.config, "tie_word_embeddings", False)
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    untie = (
        tied
        and head is not None
        and not torch.equal(
            state[f"{name_of(model, head)}.weight"], state[f"{name_of(model, embedding)}.weight"]
        )
    )
    model.config.tie_word_embeddings = tied and not untie
    try:
        model.save_pretrained(directory, state_dict=state)
    finally:
        model.config.tie_word_embeddings = tied


def name_of(model, module):
    return next(name for name, m in model.named_modules() if m is module)


def merged_state_dict(peft_model):
    """The base model's weights with each LoRA update added (W + scale·B·A), under the base
    model's own names, for a checkpoint that from_pretrained loads without peft. The live model
    is not touched: merging in place and unmerging again would not give back the same bits, and
    resume would not be exact."""
    from peft.tuners.lora import LoraLayer

    base = peft_model.get_base_model()
    merged = {
        f"{name}.weight": (
            m.get_base_layer().weight + m.get_delta_weight(m.active_adapters[0])
        ).detach()
        for name, m in base.named_modules()
        if isinstance(m, LoraLayer)
    }
    state = {}
    for key, value in base.state_dict().items():
        if "lora_" not in key:
            key = key.replace(".base_layer.", ".")
            state[key] = merged.get(key, value)
    return state


def load_policy(resume_dir, model, args):
    """π_θ as the checkpoint left it (fp32 weights), after checking it was trained from `model`'s
    architecture."""
    check_same_architecture(
        model.config, AutoConfig.from_pretrained(resume_dir), args.model, resume_dir
    )
    return AutoModelForCausalLM.from_pretrained(
        resume_dir, dtype=torch.float32, trust_remote_code=args.trust_remote_code
    )


def restore(resume_dir, args, optimizer, scheduler, scaler, ref_model=None, model=None):
    """A resumed run's AdamW state, LR schedule, fp16 loss scaler and this rank's RNG, after
    checking that its flags are the checkpoint's, and π_ref as the checkpoint holds it after a
    reset (--ref-update-every; ref_model: the run's). Under --fsdp, AdamW's shards are read from
    the checkpoint's optimizer/ into `model`'s sharded optimizer (a collective). Returns the step
    the checkpoint was saved after."""
    state = load_state(resume_dir)
    check_same_flags(state["args"], args)
    if args.fsdp:
        restore_sharded(resume_dir, state, model, optimizer)
    else:
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    schedule_for(scheduler, optimizer)
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    set_rng_state(state.get("rngs", [state["rng"]])[distributed.rank()])  # this rank's own
    if state.get("reference") is not None and ref_model is not None:  # --ref-update-every
        ref_model.load_state_dict(state["reference"])
    print(f"resumed from {resume_dir} at step {state['step']}")
    steps = state["args"].get("steps")
    if steps is not None and steps != args.steps:
        print(
            f"--steps {args.steps} (the checkpoint's: {steps}): the {args.lr_scheduler} schedule "
            f"runs over {args.steps * args.num_iterations} updates now; the next update's learning "
            f"rate is {scheduler.get_last_lr()[0]:.3g}"
        )
    if state["step"] >= args.steps:  # nothing left to train: say so, and how to go on
        print(
            f"the run is complete ({state['step']} of {args.steps} steps): nothing to train; pass "
            f"--steps N larger than {state['step']} to train further"
        )
    return state["step"]


def restore_sharded(resume_dir, state, model, optimizer):
    """FSDP2's AdamW state from `resume_dir`/optimizer (save_sharded), each rank its own shards. The
    number of processes is the checkpoint's (check_same_flags refused another: the global batch and
    each rank's RNG depend on it). A checkpoint saved under --fsdp before its AdamW state was kept
    cannot continue exactly: a UserError."""
    directory = os.path.join(resume_dir, state.get("sharded_optimizer") or SHARDED)
    if not os.path.isfile(os.path.join(directory, ".metadata")):
        raise UserError(
            f"--resume: {resume_dir} holds the weights of an --fsdp run but not its sharded AdamW "
            f"state ({directory} is missing: it was saved by a version that did not keep it), so "
            "the run cannot continue exactly. Start a new run from its weights (--model "
            f"{resume_dir}) in another --output-dir."
        )
    distributed.load_sharded_optimizer(model, optimizer, directory)


def schedule_for(scheduler, optimizer):
    """The learning rates of the schedule as built for this run (over --steps x --num-iterations
    updates), at the restored update count. load_state_dict restores the count and the base
    rates, but the optimizer's rates are the saved run's: after a run of 2 steps on a linear
    schedule, 0, and with --steps raised on --resume the next update would run at lr 0 (and log
    it). Unchanged --steps gives back exactly the saved rates (the same formula on the same
    numbers): resume stays bit-identical."""
    if not hasattr(scheduler, "lr_lambdas"):  # not a LambdaLR (every transformers schedule is one)
        return
    rates = [
        base * schedule(scheduler.last_epoch)
        for schedule, base in zip(scheduler.lr_lambdas, scheduler.base_lrs)
    ]
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate
    scheduler._last_lr = rates  # what get_last_lr() returns, as LRScheduler.step sets it


def check_resumed_finite(model, optimizer, resume_dir):
    """UserError when the weights (π_θ, as loaded from the checkpoint) or AdamW's moments (none
    checked when `optimizer` is None: --eval-only) hold NaN or inf: the run would start from them
    and stop at its first update, blaming --lr. save_run never writes such weights, so the
    checkpoint was written otherwise or damaged since (its headers and sizes are whole: find_last
    checked them)."""
    bad, anywhere = nonfinite_weights(model)
    names = {id(p): n for n, p in model.named_parameters()}
    moments = sorted(
        f"{names.get(id(p), 'a parameter')} ({key})"
        for p, state in (optimizer.state.items() if optimizer is not None else ())
        for key, value in state.items()
        if torch.is_tensor(value)
        and value.is_floating_point()
        and not local(value).isfinite().all()  # FSDP2: this rank's shard
    )
    # FSDP2's moments are sharded: any rank's (every rank agrees, and stops alike)
    moments_anywhere = (
        distributed.all_sum([len(moments)])[0] > 0 if optimizer is not None else False
    )
    if not anywhere and not moments_anywhere:
        return
    what = (
        f"weights (NaN or inf in {', '.join(bad[:3])}{' and others' if len(bad) > 3 else ''})"
        if bad
        else "weights (NaN or inf on another rank)"
        if anywhere
        else f"AdamW state (NaN or inf in {', '.join(moments[:3])}"
        + (" and others" if len(moments) > 3 else "")
        + ")"
        if moments
        else "AdamW state (NaN or inf on another rank)"
    )
    raise UserError(
        f"--resume: {resume_dir} holds non-finite {what}, so it is not used: training would stop "
        "at its first update, whatever --lr, and an evaluation would score NaN. This trainer never "
        "saves such a checkpoint: it was written otherwise or damaged since. Restore the directory "
        "from a copy, or start over with --overwrite (or in another --output-dir)."
    )


SHAPE_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)


def check_same_architecture(initial, saved, model_name, resume_dir):
    """UserError when the checkpoint was trained from another model than --model (π_ref and
    π_θinit come from it)."""
    differ = [
        f"{k} {getattr(saved, k, None)} vs {getattr(initial, k, None)}"
        for k in SHAPE_KEYS
        if getattr(saved, k, None) != getattr(initial, k, None)
    ]
    if differ:
        raise UserError(
            f"--resume: {resume_dir} holds a different model than --model {model_name} ("
            + ", ".join(differ)
            + "). Pass the --model the run started from."
        )


# The flags a resumed run may change (docs/reliability.md). Every other flag must be the
# checkpoint's: the run would otherwise not continue the one it resumes. Paths may move; --steps
# stretches or shortens the LR schedule (schedule_for); the time and memory limits of user code
# may be raised (a tool or reward that timed out says to raise its limit, then resume).
MAY_CHANGE_ON_RESUME = {
    "resume",
    "overwrite",
    "reward_timeout",
    "reward_memory",
    "tool_timeout",
    "report_to",
    "steps",
    "eval_every",
    "save_every",
    "sample_every",
    "eval_only",
    "eval_limit",
    "eval_samples",
    "eval_temperature",
    "eval_seed",
    "eval_batch_size",
    "eval_data",
    "stop_when_zero_std",
    "max_nonfinite",
    "plot",
    "output_dir",
    "model",
    "data",
    "device",
    # how the decode runs (fused, CUDA graphs or eager), and the memory's choice: the same
    # computation, bit for bit on the CPU; on CUDA other kernels may round otherwise (exact resume
    # is the CPU's promise anyway, docs/reliability.md)
    "decode",
    "gradient_checkpointing",
}


def differing_flags(saved, args):
    """The flags outside MAY_CHANGE_ON_RESUME whose value differs from the checkpoint's, sorted."""
    return [
        k
        for k, v in sorted(vars(args).items())
        if k not in MAY_CHANGE_ON_RESUME and k in saved and saved[k] != v
    ]


def check_same_flags(saved, args):
    """UserError naming every flag (outside MAY_CHANGE_ON_RESUME) whose value differs from the
    checkpoint's."""
    differ = differing_flags(saved, args)
    if differ:
        changes = "; ".join(
            # world_size is no flag: torchrun's process count (the global batch, each rank's RNG
            # and, under --fsdp, the sharding depend on it)
            f"the number of processes (torchrun --nproc-per-node) was {saved[k]!r}, now "
            f"{getattr(args, k)!r}"
            if k == "world_size"
            else f"--{k.replace('_', '-')} was {saved[k]!r}, now {getattr(args, k)!r}"
            for k in differ
        )
        raise UserError(
            f"--resume: flags differ from the checkpoint's ({changes}). Pass them as they were to continue "
            "that run, or start a new one in another --output-dir. May change on resume: "
            + ", ".join(f"--{k.replace('_', '-')}" for k in sorted(MAY_CHANGE_ON_RESUME))
            + "."
        )


def reference_state(run, args, step):
    """What π_ref is after `step` with --ref-update-every K (Algorithm 1's outer loop; None
    without it, or before the first reset: then π_ref is π_θinit, rebuilt from the model): π_θ's
    weights at a step that ends an iteration (step % K == 0: π_ref ← π_θ, whether or not the loop
    has copied them yet), else the reference model's own. restore loads them back."""
    K = getattr(args, "ref_update_every", 0)
    if not K or step < K:
        return None
    source = run.model if step % K == 0 else run.ref_model
    return {k: v.detach().cpu().clone() for k, v in source.state_dict().items()}


def reset_reference(ref_model, model):
    """π_ref ← π_θ (Algorithm 1, lines 2-3: a new iteration), in π_ref's own dtypes (the autocast
    dtype for its parameters, as models.reference_model keeps them)."""
    ref_model.load_state_dict(model.state_dict())


def save_run(run, args, step, rng, final=False):
    """A checkpoint of the run after `step`. With LoRA the adapter, and also the merged model
    when the run ends here (the last step, an early stop, an interruption: `final`), so that the
    checkpoint a run leaves behind always loads with from_pretrained. Weights that are not finite
    are refused first (NonFiniteWeights), on every rank at once: nothing is written, and the last
    checkpoint stands."""
    check_finite(run.model, args.output_dir, step)
    # every rank's RNG (under torchrun each samples its own completions)
    rngs = distributed.gather_objects(rng)
    state = dict(
        step=step,
        # FSDP2: AdamW's state is sharded; every rank writes its shards (save_sharded)
        optimizer=None if args.fsdp else run.optimizer.state_dict(),
        sharded_optimizer=SHARDED if args.fsdp else None,
        scheduler=run.scheduler.state_dict(),
        scaler=run.scaler.state_dict() if run.scaler is not None else None,
        rng=rng,
        rngs=rngs,
        args=vars(args),
        reference=reference_state(run, args, step),
    )
    # FSDP2: the whole weights gathered onto rank 0 (from_pretrained loads them, and --resume)
    weights = distributed.full_state_dict(run.model) if args.fsdp else None
    if args.fsdp:  # and AdamW's shards, by every rank, into checkpoint.tmp/optimizer
        save_sharded(run, args.output_dir)
    # the weights and AdamW are the same on every rank (FSDP2: gathered): rank 0 writes them
    if distributed.is_main():
        size, t0 = checkpoint_bytes(run.model), time.time()
        if (
            size > LARGE_SAVE_BYTES
        ):  # seconds to minutes on a large model: say so before, not only after
            print(f"saving a checkpoint at step {step} ({size / 1e9:.1f} GB) ...", flush=True)
        path = save(
            args.output_dir,
            run.model,
            run.tokenizer,
            state,
            run.peft,
            merge=final or step >= args.steps,
            weights=weights,
            sharded=args.fsdp,
        )
        print(f"saved {path} (step {step}) in {time.time() - t0:.1f} s", flush=True)
    distributed.barrier()


# Under FSDP2, the directory inside a checkpoint that holds AdamW's sharded state
# (torch.distributed.checkpoint: a file per rank and .metadata); training_state.pt names it.
SHARDED = "optimizer"


def save_sharded(run, output_dir):
    """FSDP2's AdamW state, each rank's shards, into checkpoint.tmp/optimizer (a collective, on
    every rank): the first part of save's checkpoint.tmp, which rank 0 then completes and swaps in.
    A failed write on any rank fails every rank alike (DCP gathers the errors): SaveFailed, tmp
    removed, nothing replaced."""
    from torch.distributed.checkpoint.api import CheckpointException

    tmp = os.path.join(output_dir, "checkpoint.tmp")
    if distributed.is_main():
        shutil.rmtree(tmp, ignore_errors=True)  # a killed save's leftovers
    distributed.barrier()  # removed before any rank writes into it
    try:
        distributed.save_sharded_optimizer(run.model, run.optimizer, os.path.join(tmp, SHARDED))
    except (CheckpointException, *WRITE_ERRORS) as e:  # raised on every rank, writes all ended
        if distributed.is_main():
            shutil.rmtree(tmp, ignore_errors=True)
        part = "AdamW's sharded state"
        if isinstance(e, CheckpointException) and e.failures:  # the first rank's own error
            rank, (e, _) = min(e.failures.items(), key=lambda item: item[0])
            part += f", rank {rank}"
        raise save_failed(tmp, part, e, output_dir) from None


def save_failed(tmp, part, e, output_dir):
    """The SaveFailed for a write into checkpoint.tmp (`part` of it) that failed with `e`."""
    kept, resumable = last_checkpoint_in_words(output_dir)
    return SaveFailed(
        f"could not write a checkpoint into {tmp} ({part}): {failure(e)}. Nothing was replaced: "
        f"{kept}. {free_space(output_dir)}Free space (or pass another --output-dir) and rerun with "
        + ("--resume." if resumable else "--overwrite: there is no checkpoint to resume from.")
    )


LARGE_SAVE_BYTES = 1e9  # a save announces itself beforehand above this size


def checkpoint_bytes(model):
    """About how many bytes a checkpoint of `model` writes: its weights, and AdamW's two fp32
    moments of each trainable weight (this rank's shards under FSDP2: a lower bound)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return weights + sum(2 * 4 * p.numel() for p in model.parameters() if p.requires_grad)


def save_interrupted(run, args, step, updated, rng_at_start, stopped_by=None):
    """Ctrl-C (or an error that stops the run) inside `step`. Before its first update, the
    weights and optimizer are those of the end of the last step: save them with the RNG as it was
    then, so --resume redoes this step exactly. After an update, count the step as done (its
    remaining μ updates are skipped); --resume samples the next batch."""
    # signals.Stopped: a signal stopped the run at this step's end, on every rank at once
    everywhere = getattr(stopped_by, "everywhere", False)
    if isinstance(stopped_by, WriteFailed) or (distributed.world() > 1 and not everywhere):
        # a save or a metrics line failed, or the weights are not finite (the last checkpoint
        # stands), or the other ranks are not there to save with
        return
    done = step + 1 if updated else step
    rng_at_start = {**rng_state(), **rng_at_start}  # numpy's and Python's: as they are
    if getattr(stopped_by, "saved", False):
        print(f"\n{stopped_by}: step {done} is saved; exiting", file=sys.stderr, flush=True)
        return
    why = (
        "stopped"
        if stopped_by is not None and not isinstance(stopped_by, KeyboardInterrupt)
        else f"{stopped_by}"
        if everywhere
        else "interrupted"
    )
    print(
        f"\n{why}: saving a checkpoint at step {done} before exiting", file=sys.stderr, flush=True
    )
    save_run(run, args, done, rng_state() if updated else rng_at_start, final=True)


def rng_state():
    state = dict(
        python=random.getstate(),
        torch=torch.get_rng_state(),
        numpy={
            k: v.tolist() if isinstance(v, np.ndarray) else v
            for k, v in zip(("kind", "keys", "pos", "has_gauss", "cached"), np.random.get_state())
        },
    )
    if torch.cuda.is_available():
        # this process's device's (the one it samples on)
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state):
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], np.array(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"], n["cached"])
    )
    if "cuda" in state and torch.cuda.is_available():
        # This process's device's state. Checkpoints written before saved every visible GPU's (a
        # list): the one of the device this process runs on, if that machine had it, else the first.
        # A run saved on a GPU resumes on another machine, another GPU count, or the CPU (--device
        # may change on resume).
        cuda = state["cuda"]
        if isinstance(cuda, (list, tuple)):
            cuda = (
                cuda[torch.cuda.current_device()]
                if torch.cuda.current_device() < len(cuda)
                else cuda[0]
            )
        torch.cuda.set_rng_state(cuda)


def save(
    output_dir,
    model,
    tokenizer,
    training_state,
    peft_model=None,
    merge=True,
    weights=None,
    sharded=False,
):
    """Write OUTPUT_DIR/checkpoint atomically: into checkpoint.tmp, fsynced, then swap it in with
    renames, so a crash or power loss at any moment leaves a complete checkpoint (the new one, or
    the previous one as checkpoint.old). With LoRA (peft_model) the adapter goes into
    checkpoint/adapter, and the merged model beside it if `merge`. `sharded` (FSDP2): every rank
    has written AdamW's shards into checkpoint.tmp/optimizer already (save_sharded): kept, and
    swapped in with the rest. A write that fails (a full disk: OSError from Python's own writes,
    RuntimeError from torch.save, SafetensorError from safetensors) removes checkpoint.tmp and is a
    SaveFailed; nothing was replaced."""
    final = os.path.join(output_dir, "checkpoint")
    tmp, old = final + ".tmp", final + ".old"
    if not sharded:
        shutil.rmtree(tmp, ignore_errors=True)
    part = "the adapter"  # what is being written, for the message when it fails
    try:
        if peft_model is not None:
            peft_model.save_pretrained(os.path.join(tmp, "adapter"))
            fsync_tree(os.path.join(tmp, "adapter"))
        part = "the weights"
        if peft_model is None:
            model.save_pretrained(tmp, **({"state_dict": weights} if weights is not None else {}))
        elif merge:
            save_merged(model, peft_model, tmp)
        part = "the tokenizer"
        tokenizer.save_pretrained(tmp)
        part = "training_state.pt"
        torch.save(training_state, os.path.join(tmp, "training_state.pt"))
        # on disk before the renames: a power loss cannot leave a renamed but empty file
        part = "fsync"
        if sharded:  # DCP fsynced its files: their directory's entries too
            fsync_tree(os.path.join(tmp, SHARDED), files=False)
        fsync_tree(tmp)
    except WRITE_ERRORS as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise save_failed(tmp, part, e, output_dir) from None
    fault_injection_pause()
    if os.path.isdir(final):
        if os.path.isdir(old) and verify(final) is not None and verify(old) is None:
            # The run resumed from checkpoint.old because checkpoint is damaged (find_last): the
            # whole one stays the fallback until the new one is in place.
            shutil.rmtree(final)
        else:
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        fault_injection_pause()
    os.replace(tmp, final)
    fsync_tree(output_dir, files=False)  # the renames themselves
    shutil.rmtree(old, ignore_errors=True)
    return final


# What a write into a full disk (ENOSPC), a quota or a vanished directory raises: OSError from
# Python's own writes (the tokenizer's files, fsync), RuntimeError from torch.save, SafetensorError
# from safetensors (neither says the errno).
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)


def check_finite(model, output_dir, step):
    """NonFiniteWeights, on every rank, when any weight of `model` is NaN or inf (under FSDP2,
    any rank's shard)."""
    bad, anywhere = nonfinite_weights(model)
    if not anywhere:
        return
    where = (
        f" in {', '.join(bad[:3])}{' and others' if len(bad) > 3 else ''}"
        if bad
        else " on another rank"
    )
    kept, resumable = last_checkpoint_in_words(output_dir)
    raise NonFiniteWeights(
        f"the weights after step {step} are not finite (NaN or inf{where}), so no checkpoint was written: nothing "
        f"was replaced, {kept}. "
        + ("--resume continues from it; " if resumable else "")
        + "lower --lr or set --max-grad-norm if it happens again."
    )


def nonfinite_weights(model, trainable_only=False):
    """The names of this rank's weights that hold NaN or inf (all of them, or the trainable ones
    only), and whether any rank has one. One fused kernel per dtype on the device, the largest
    |w| of each tensor (a max cannot overflow, as a sum of squares can), one sync, and one
    all-reduce under torchrun so that every rank agrees."""
    tensors = [
        (n, p.detach())
        for n, p in model.named_parameters()
        if p.requires_grad or not trainable_only
    ]
    tensors = [(n, p.to_local() if hasattr(p, "to_local") else p) for n, p in tensors]
    tensors = [(n, p) for n, p in tensors if p.numel()]
    bad = []
    if tensors:
        largest = torch._foreach_norm([p for _, p in tensors], math.inf)
        # one sync
        values = torch.stack([m.float().to(largest[0].device) for m in largest]).tolist()
        bad = [n for (n, _), v in zip(tensors, values) if not math.isfinite(v)]
    return bad, distributed.all_sum([len(bad)])[0] > 0


def local(tensor):
    """This rank's shard of a DTensor (FSDP2's parameters and AdamW moments), else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def last_checkpoint_in_words(output_dir):
    """Which checkpoint stands in `output_dir`, in words for a message that says nothing was
    replaced, and whether there is one to resume from."""
    path = find_last(output_dir, quiet=True)
    if path is None:
        return "no checkpoint is kept", False
    step = checkpoint_step(path)
    return f"the previous checkpoint, {path}, is intact" + (
        f" (step {step})" if step is not None else ""
    ), True


def checkpoint_step(path):
    """The step a checkpoint was saved after, None when it cannot be read."""
    return state_header(path).get("step")


def saved_flags(path):
    """The flags a checkpoint was saved with ({name: value}), None when they cannot be read."""
    return state_header(path).get("args")


def state_header(path):
    """training_state.pt of a checkpoint directory, memory-mapped: no tensor is read, so it is
    cheap for a 14 GB file too. {} when it cannot be read (a damaged file: the message that asks
    names the path alone)."""
    try:
        state = torch.load(
            os.path.join(path, "training_state.pt"),
            map_location="cpu",
            weights_only=True,
            mmap=True,
        )
    except Exception:
        return {}
    return state if isinstance(state, dict) else {}


def free_space(directory):
    """The words "N MiB free there. " for a message about a failed write ("" when it cannot be
    told)."""
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return ""
    return (
        f"{free / 2**30:.1f} GiB free there. "
        if free >= 2**30
        else f"{free / 2**20:.1f} MiB free there. "
    )


def fault_injection_pause():
    """GRPO_SAVE_PAUSE=SECONDS widens the moments between a save's steps, so the fault-injection
    test's random SIGKILLs land inside saves often (test_faults.py,
    test_sigkill_at_random_moments_...). Unset: no pause."""
    if os.environ.get("GRPO_SAVE_PAUSE"):
        time.sleep(float(os.environ["GRPO_SAVE_PAUSE"]))


def fsync_tree(directory, files=True):
    """fsync every file in `directory` (files=True), then the directory's own entry list."""
    names = sorted(os.listdir(directory)) if files else []
    for path in [
        os.path.join(directory, n) for n in names if os.path.isfile(os.path.join(directory, n))
    ]:
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def find_last(output_dir, quiet=False):
    """OUTPUT_DIR/checkpoint if it is whole (verify), else checkpoint.old if that one is: a crash
    hit between save's two renames, or checkpoint is damaged (said in one line on stderr). None
    when there is neither. A UserError when each one there is damaged, naming what is wrong
    (quiet: None, and nothing printed)."""
    damaged = []
    for name in ("checkpoint", "checkpoint.old"):
        path = os.path.join(output_dir, name)
        if not os.path.isdir(path):
            continue
        problem = verify(path)
        if problem is None:
            if damaged and not quiet and distributed.is_main():
                print(
                    f"{damaged[0]}; using {path}, the checkpoint before it",
                    file=sys.stderr,
                    flush=True,
                )
            elif name == "checkpoint.old" and not quiet and distributed.is_main():
                print(interrupted_save_note(output_dir, path), file=sys.stderr, flush=True)
            return path
        damaged.append(f"{path} is damaged: {problem}")
    if damaged and not quiet:
        raise UserError(
            "; ".join(damaged)
            + (", and there is no checkpoint.old to fall back to" if len(damaged) == 1 else "")
            + ". This run cannot continue from it: restore the directory from a copy, or start over with --overwrite "
            "(or in another --output-dir)."
        )
    return None


def interrupted_save_note(output_dir, old):
    """The line find_last prints when it falls back to checkpoint.old with no checkpoint beside it:
    a save was stopped between its two renames (a second Ctrl-C, a kill). What resume does: go on
    from checkpoint.old; the unfinished checkpoint.tmp is not used (the next save replaces it)."""
    step = checkpoint_step(old)
    tmp = os.path.join(output_dir, "checkpoint.tmp")
    left = f"{old} and {tmp} are left" if os.path.isdir(tmp) else f"{old} is left"
    at = f" at step {step}" if step is not None else ""
    return (
        f"a save was interrupted between its renames ({left}, no checkpoint): continuing from "
        f"{old}{at}, the last complete save; "
        + (f"{tmp} is not used (the next save replaces it)" if os.path.isdir(tmp) else "")
    ).rstrip("; ")


def verify(path):
    """None when the checkpoint directory `path` is whole, else what is wrong with it, naming the
    file. Cheap (no tensor is read, whatever the size): training_state.pt is a whole zip archive
    (torch.save's format) whose members lie within the file; each .safetensors file's header
    parses and the file is exactly as long as the header says; each .json file parses; and the
    weights are there (config.json and model.safetensors or its index's shards; with LoRA,
    adapter/adapter_config.json and adapter/adapter_model.safetensors); under --fsdp, the files
    of AdamW's sharded state are there and as long as their .metadata says (sharded_problem)."""
    adapter = os.path.join(path, "adapter")
    needed = ["training_state.pt"] + (
        ["adapter/adapter_config.json", "adapter/adapter_model.safetensors"]
        if os.path.isdir(adapter)
        else ["config.json"]
    )
    try:
        for name in needed:
            if not os.path.isfile(os.path.join(path, name)):
                return f"{name} is missing"
        problem = zip_problem(os.path.join(path, "training_state.pt"))
        if problem:
            return f"training_state.pt {problem}"
        for directory, prefix in ((path, ""), (adapter, "adapter/")):
            names = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
            for name in names:
                file = os.path.join(directory, name)
                if name.endswith(".json"):
                    problem = json_problem(file)
                elif name.endswith(".safetensors"):
                    problem = safetensors_problem(file)
                else:
                    continue
                if problem:
                    return f"{prefix}{name} {problem}"
        if os.path.isdir(os.path.join(path, SHARDED)):
            problem = sharded_problem(os.path.join(path, SHARDED))
            if problem:
                return f"{SHARDED}/{problem}"
        if not os.path.isdir(adapter):
            return weights_problem(path)
    except OSError as e:  # a file removed or unreadable while we look
        return f"{e.filename}: {e.strerror}"
    return None


def sharded_problem(directory):
    """What is wrong with a torch.distributed.checkpoint directory (FSDP2's AdamW state), or None:
    its .metadata reads, and each file it names holds the bytes it says (no tensor is read)."""
    from torch.distributed.checkpoint import FileSystemReader

    if not os.path.isfile(os.path.join(directory, ".metadata")):
        return ".metadata is missing (the save did not finish)"
    try:
        metadata = FileSystemReader(directory).read_metadata()
        ends = {}
        for info in metadata.storage_data.values():
            ends[info.relative_path] = max(
                ends.get(info.relative_path, 0), info.offset + info.length
            )
    except Exception as e:  # a damaged pickle: any error its reading raises
        return f".metadata is damaged ({type(e).__name__}: {str(e)[:200]})"
    for name, end in sorted(ends.items()):
        file = os.path.join(directory, name)
        if not os.path.isfile(file):
            return f"{name} is missing (.metadata names it)"
        if os.path.getsize(file) < end:
            return f"{name} is cut short ({os.path.getsize(file):,} bytes; .metadata says {end:,})"
    return None


def zip_problem(file):
    """What is wrong with a torch.save file (a zip archive), or None."""
    size = os.path.getsize(file)
    try:
        with zipfile.ZipFile(file) as archive:
            for info in archive.infolist():
                if info.header_offset + info.compress_size > size:
                    return f"is cut short ({size:,} bytes; {info.filename} needs more)"
    except zipfile.BadZipFile as e:
        return f"is cut short or damaged ({size:,} bytes, not a whole torch.save archive: {e})"
    return None


def safetensors_problem(file):
    """What is wrong with a .safetensors file, or None: an 8-byte header length, a JSON header,
    then exactly the bytes its tensors' data_offsets cover."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else None
        if length is None or length > size - 8:
            return f"is cut short ({size:,} bytes, less than its header)"
        try:
            header = json.loads(f.read(length))
            end = max(
                (v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0
            )
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return "has a damaged header"
    expected = 8 + length + end
    if size != expected:
        return f"is {'cut short' if size < expected else 'too long'} ({size:,} bytes; its header says {expected:,})"
    return None


def json_problem(file):
    """What is wrong with a JSON file of a checkpoint (config.json, the tokenizer's), or None."""
    try:
        with open(file, encoding="utf-8") as f:
            value = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        return f"is not valid JSON ({e})"
    return None if isinstance(value, dict) else "is not a JSON object"


def weights_problem(path):
    """None when a save_pretrained directory has its weights: model.safetensors, or every shard
    its index names."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f).get("weight_map", {}).values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
        return (
            f"{missing[0]} is missing (model.safetensors.index.json names it)" if missing else None
        )
    return (
        None
        if os.path.isfile(os.path.join(path, "model.safetensors"))
        else "model.safetensors is missing"
    )


def load_state(path):
    """training_state.pt of a checkpoint directory (the weights are loaded with from_pretrained)."""
    # Onto the CPU: under torchrun every rank would otherwise load rank 0's AdamW moments onto rank
    # 0's GPU. optimizer.load_state_dict then moves each state to its parameter's device.
    file = os.path.join(path, "training_state.pt")
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    # damage verify cannot see (it reads no tensor)
    except (RuntimeError, EOFError, ValueError, OSError, zipfile.BadZipFile) as e:
        raise UserError(
            f"could not read {file} ({failure(e)}): the checkpoint is damaged. Restore the directory "
            "from a copy, or start over with --overwrite (or in another --output-dir)."
        ) from None
