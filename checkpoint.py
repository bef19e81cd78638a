"""Checkpoints: saving a run, finding the last checkpoint, and restoring a run from it.

OUTPUT_DIR/checkpoint holds save_pretrained's model + tokenizer, so AutoModelForCausalLM.from_pretrained loads it, and
training_state.pt: optimizer, scheduler (and fp16's loss scaler), step and RNG states, and the flags. It is written
into checkpoint.tmp, fsynced and renamed into place. A run's data position needs no saving: the batch of step s is a
pure function of the seed and s (data.batch_at); its evaluations are read back from metrics.jsonl.
"""

import os
import random
import shutil
import sys
import time

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import distributed
from errors import UserError


def policy_loaded_from_checkpoint(args, resume_dir):
    """Whether --resume loads the checkpoint in place of π_θinit: with β = 0 no reference model needs the initial
    weights (the demo always builds its model in code)."""
    return resume_dir is not None and args.beta == 0 and not args.demo and not args.lora_rank


def save_merged(model, peft_model, directory):
    """The merged model (merged_state_dict) as an ordinary save_pretrained directory. An adapter on a tied lm-head
    (or input embedding) makes the two differ: the saved config then unties them, or loading would re-tie them."""
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
    """The base model's weights with each LoRA update added (W + scale·B·A), under the base model's own names, for
    a checkpoint that from_pretrained loads without peft. The live model is not touched: merging in place and
    unmerging again would not give back the same bits, and resume would not be exact."""
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
    """π_θ as the checkpoint left it (fp32 weights), after checking it was trained from `model`'s architecture."""
    check_same_architecture(
        model.config, AutoConfig.from_pretrained(resume_dir), args.model, resume_dir
    )
    return AutoModelForCausalLM.from_pretrained(
        resume_dir, dtype=torch.float32, trust_remote_code=args.trust_remote_code
    )


def restore(resume_dir, args, optimizer, scheduler, scaler):
    """A resumed run's AdamW state, LR schedule, fp16 loss scaler and this rank's RNG, after checking that its flags
    are the checkpoint's. Returns the step the checkpoint was saved after."""
    state = load_state(resume_dir)
    check_same_flags(state["args"], args)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    set_rng_state(state.get("rngs", [state["rng"]])[distributed.rank()])  # this rank's own
    print(f"resumed from {resume_dir} at step {state['step']}")
    return state["step"]


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
    """UserError when the checkpoint was trained from another model than --model (π_ref and π_θinit come from it)."""
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


# The flags a resumed run may change (docs/reliability.md). Every other flag must be the checkpoint's: the
# run would otherwise not continue the one it resumes. Paths may move; --steps stretches or shortens the LR schedule.
MAY_CHANGE_ON_RESUME = {
    "resume",
    "overwrite",
    "reward_timeout",
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
}


def check_same_flags(saved, args):
    """UserError naming every flag (outside MAY_CHANGE_ON_RESUME) whose value differs from the checkpoint's."""
    differ = [
        k
        for k, v in sorted(vars(args).items())
        if k not in MAY_CHANGE_ON_RESUME and k in saved and saved[k] != v
    ]
    if differ:
        changes = "; ".join(
            f"--{k.replace('_', '-')} was {saved[k]!r}, now {getattr(args, k)!r}" for k in differ
        )
        raise UserError(
            f"--resume: flags differ from the checkpoint's ({changes}). Pass them as they were to continue "
            "that run, or start a new one in another --output-dir. May change on resume: "
            + ", ".join(f"--{k.replace('_', '-')}" for k in sorted(MAY_CHANGE_ON_RESUME))
            + "."
        )


def save_run(run, args, step, rng, final=False):
    """A checkpoint of the run after `step`. With LoRA the adapter, and also the merged model when the run ends here
    (the last step, an early stop, an interruption: `final`), so that the checkpoint a run leaves behind always loads
    with from_pretrained."""
    # every rank's RNG (under torchrun each samples its own completions)
    rngs = distributed.gather_objects(rng)
    state = dict(
        step=step,
        optimizer=run.optimizer.state_dict(),
        scheduler=run.scheduler.state_dict(),
        scaler=run.scaler.state_dict() if run.scaler is not None else None,
        rng=rng,
        rngs=rngs,
        args=vars(args),
    )
    # FSDP2: gathered onto rank 0
    weights = distributed.full_state_dict(run.model) if args.fsdp else None
    # the weights and AdamW are the same on every rank: rank 0 writes them
    if distributed.is_main():
        if args.fsdp:  # AdamW's state is sharded too: the checkpoint holds the weights (--resume: not with --fsdp)
            state["optimizer"] = None
        path = save(
            args.output_dir,
            run.model,
            run.tokenizer,
            state,
            run.peft,
            merge=final or step >= args.steps,
            weights=weights,
        )
        print(f"saved {path} (step {step})", flush=True)
    distributed.barrier()


def save_interrupted(run, args, step, updated, rng_at_start, stopped_by=None):
    """Ctrl-C (or an error that stops the run) inside `step`. Before its first update, the weights and optimizer are
    those of the end of the last step: save them with the RNG as it was then, so --resume redoes this step exactly.
    After an update, count the step as done (its remaining μ updates are skipped); --resume samples the next batch."""
    # train.Stopped: a signal stopped the run at this step's end, on every rank at once
    everywhere = getattr(stopped_by, "everywhere", False)
    if isinstance(stopped_by, SaveFailed) or (distributed.world() > 1 and not everywhere):
        return  # the save failed (the last checkpoint stands), or the other ranks are not there to save with
    done = step + 1 if updated else step
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
        # This process's device's state. Checkpoints written before saved every visible GPU's (a list): the one of
        # the device this process runs on, if that machine had it, else the first. A run saved on a GPU resumes on
        # another machine, another GPU count, or the CPU (--device may change on resume).
        cuda = state["cuda"]
        if isinstance(cuda, (list, tuple)):
            cuda = (
                cuda[torch.cuda.current_device()]
                if torch.cuda.current_device() < len(cuda)
                else cuda[0]
            )
        torch.cuda.set_rng_state(cuda)


def save(output_dir, model, tokenizer, training_state, peft_model=None, merge=True, weights=None):
    """Write OUTPUT_DIR/checkpoint atomically: into checkpoint.tmp, fsynced, then swap it in with renames, so a crash
    or power loss at any moment leaves a complete checkpoint (the new one, or the previous one as checkpoint.old).
    With LoRA (peft_model) the adapter goes into checkpoint/adapter, and the merged model beside it if `merge`."""
    final = os.path.join(output_dir, "checkpoint")
    tmp, old = final + ".tmp", final + ".old"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if peft_model is not None:
            peft_model.save_pretrained(os.path.join(tmp, "adapter"))
            fsync_tree(os.path.join(tmp, "adapter"))
        if peft_model is None:
            model.save_pretrained(tmp, **({"state_dict": weights} if weights is not None else {}))
        elif merge:
            save_merged(model, peft_model, tmp)
        tokenizer.save_pretrained(tmp)
        torch.save(training_state, os.path.join(tmp, "training_state.pt"))
        # on disk before the renames: a power loss cannot leave a renamed but empty file
        fsync_tree(tmp)
    except OSError as e:  # a full disk (ENOSPC), a quota: the previous checkpoint was not touched
        shutil.rmtree(tmp, ignore_errors=True)
        previous = find_last(output_dir)
        kept = (
            f"the previous checkpoint, {previous}, is intact"
            if previous
            else "no checkpoint is kept"
        )
        raise SaveFailed(
            f"could not write a checkpoint into {tmp}: {e.strerror or e}. Nothing was replaced: {kept}. "
            "Free space (or pass another --output-dir) and rerun with --resume."
        ) from None
    fault_injection_pause()
    if os.path.isdir(final):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        fault_injection_pause()
    os.replace(tmp, final)
    fsync_tree(output_dir, files=False)  # the renames themselves
    shutil.rmtree(old, ignore_errors=True)
    return final


class SaveFailed(UserError):
    """Writing a checkpoint failed; the previous one is untouched (and there is nothing new to save on the way out)."""


def fault_injection_pause():
    """GRPO_SAVE_PAUSE=SECONDS widens the moments between a save's steps, so the fault-injection test's random
    SIGKILLs land inside saves often (test_faults.py, test_sigkill_at_random_moments_...). Unset: no pause."""
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


def find_last(output_dir):
    """OUTPUT_DIR/checkpoint, or checkpoint.old when a crash hit between save's two renames."""
    for name in ("checkpoint", "checkpoint.old"):
        path = os.path.join(output_dir, name)
        if os.path.isfile(os.path.join(path, "training_state.pt")):
            return path
    return None


def load_state(path):
    """training_state.pt of a checkpoint directory (the weights are loaded with from_pretrained)."""
    # Onto the CPU: under torchrun every rank would otherwise load rank 0's AdamW moments onto rank 0's GPU.
    # optimizer.load_state_dict then moves each state to its parameter's device.
    return torch.load(
        os.path.join(path, "training_state.pt"), map_location="cpu", weights_only=True
    )
