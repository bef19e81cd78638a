"""--decode fused (support/decode.py's FusedStep): the decoder layers run in a loop of our own,
through one compiled function shared by every layer (each layer gets a LayerCache, so no layer
index reaches the graph), the 4-D mask built inside the step. On CUDA GraphStep captures it; on
the CPU it runs compiled, without a graph, as here.

Tolerances. Compiled with aot_eager (dynamo's graphs, run by eager kernels) the fused decode is
the eager decode bit for bit: tokens, drawn log-probs and the RNG left behind. With inductor its
kernels sum in another order: in fp32 the logits differ by at most 3e-7 (measured, 2 layers of the
demo's width), a few ulps, so the tokens drawn from the same uniforms are the same unless a
uniform falls within that of a boundary of the cumulative distribution; the drawn log-probs are
held within 1e-5 (log-probs up to about 5, float32's epsilon 1.2e-7: some 16 ulps). Under bf16
autocast inductor keeps intermediates in fp32 where eager rounds each op to bf16 (logits within
0.004, measured): that is checked with aot_eager, bit for bit, and measured on the GPU
(scripts/gpu_check.py)."""

import pytest
import torch
import torch._dynamo.testing
from torch._dynamo.utils import counters

import config
import grpo
import sampling
from helpers import CPU, decode_with_drawn_logprobs, read_metrics, without_time
from support import decode, demo

pytestmark = pytest.mark.skipif(
    not torch._dynamo.is_dynamo_supported(), reason="torch.compile is unavailable on this Python"
)


def left_padded(lengths, vocab_size=97, seed=1):
    """[B, P] ids and mask, left-padded with id 0, prompts of the given lengths."""
    P = max(lengths)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab_size, (len(lengths), P), generator=g)
    mask = (torch.arange(P)[None] >= P - torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask


def small_model(kind):
    """The demo's width with 4 KV heads (llama: SmolLM2's layout, no grouped-query attention) or 2
    (llama-gqa), or a Qwen2 (q, k and v with biases) with 2."""
    if kind != "qwen2-gqa":
        heads = 2 if kind == "llama-gqa" else 4
        return demo.tiny_llama(97, 0, num_key_value_heads=heads, tie_word_embeddings=False).eval()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).eval()


@pytest.fixture
def counted(monkeypatch):
    """FusedStep compiled by a counting aot_eager backend (the graphs dynamo makes, no code
    generated), from a clean dynamo."""
    torch._dynamo.reset()
    counters.clear()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(decode, "FUSED_BACKEND", counter)
    yield counter
    torch._dynamo.reset()


class Replay:
    """decode.CudaGraph on the CPU: the captured step is called again at each replay, under the
    autocast it was captured in (a CUDA graph replays the kernels recorded under it)."""

    replays = 0

    def warm_up(self, fn):
        return fn()

    def capture(self, fn, like):
        on, dtype = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
        cached = torch.is_autocast_cache_enabled()
        self.autocast = lambda: torch.autocast("cpu", dtype, on, cache_enabled=cached)
        self.fn, self.out = fn, torch.empty_like(like)
        return self.out

    def replay(self):
        Replay.replays += 1
        with self.autocast():
            self.out.copy_(self.fn())


@pytest.mark.parametrize(
    "kind,amp,captured",
    [
        ("llama", None, False),
        ("llama", torch.bfloat16, False),
        ("llama", torch.bfloat16, True),
        ("llama-gqa", None, False),
        ("qwen2-gqa", torch.bfloat16, True),
    ],
    ids=["fp32", "bf16-autocast", "bf16-captured", "gqa-fp32", "qwen2-gqa-bf16-captured"],
)
def test_the_fused_decode_draws_the_eager_decodes_tokens(kind, amp, captured, counted, monkeypatch):
    # From the same random numbers, the eager decode's tokens and drawn log-probs, and the RNG
    # left where it leaves it. Left-padded prompts (their pad columns masked in the 4-D mask
    # built inside the step), rows ending at different steps (the eager decode drops them; the
    # fused one keeps every row and writes pad after EOS). captured: through GraphStep as on CUDA
    # (Replay above), the compile in its warm-up step. Bit for bit, except with grouped-query
    # attention: compiled, transformers' sdpa repeats the keys and values to every head
    # (repeat_kv) where its eager decode packs the query's heads instead (pack_gqa, skipped under
    # dynamo), another kernel shape: the log-probs within 2e-6 (measured 4.8e-7 in fp32, one ulp
    # of a log-prob of 4; 0 in these bf16 cases), the tokens the same.
    if captured:
        monkeypatch.setattr(decode, "uses_graphs", lambda s, device: s.graphs or s.fused)
        monkeypatch.setattr(decode, "CudaGraph", Replay)
        monkeypatch.setattr(Replay, "replays", 0)
    model = small_model(kind)
    model.lm_head.register_forward_hook(lambda m, i, out: [out[..., demo.EOS].add_(1.5)] and None)
    ids, mask = left_padded([5, 1, 8, 3])
    outs = []
    for fused in (False, True):
        settings = sampling.Sampling(temperature=0.9, max_new_tokens=16, fused=fused)
        torch.manual_seed(3)
        with sampling.autocast("cpu", amp):
            outs.append(decode_with_drawn_logprobs(model, ids, mask, settings, 3, [demo.EOS], 0))
        outs.append(torch.rand(1))
    (eager, eager_logps), after_eager, (fused, fused_logps), after_fused = outs
    assert torch.equal(fused, eager)
    if kind == "llama":
        assert torch.equal(fused_logps, eager_logps)
    torch.testing.assert_close(fused_logps, eager_logps, rtol=0, atol=2e-6)
    assert torch.equal(after_fused, after_eager)
    lengths = grpo.completion_mask(eager, [demo.EOS]).sum(1)
    assert len(set(lengths.tolist())) >= 4 and (lengths < 16).sum() >= 6  # rows ended apart
    assert counted.frame_count == 1  # one graph for both layers
    if captured:
        assert Replay.replays == fused.shape[1] - 2  # steps 2..C-1 replayed (1: the warm-up)


def test_the_fused_decode_compiles_one_graph_whatever_the_depth_the_prompt_length_and_the_rows(
    counted,
):
    # The whole-model compile traces each layer apart (transformers' attention indexes the cache
    # by its layer_idx): ~22 s of compile per layer on the CPU, docs/gpu.md. Here one graph serves
    # every layer, at 2 layers of the demo's width as at 8, and every later call: other prompt
    # lengths (the cache length is dynamic) and other row counts (so are the rows).
    graphs = {}
    for layers in (2, 8):
        torch._dynamo.reset()
        counters.clear()
        counted.frame_count = 0
        model = demo.tiny_llama(97, 0, num_hidden_layers=layers).eval()
        for lengths, G in (([3, 5], 4), ([9, 2, 4], 2), ([1, 6, 6, 2], 3)):
            settings = sampling.Sampling(max_new_tokens=6, fused=True)
            out = decode.plain_decode(model, *left_padded(lengths), settings, G, [-1], 0)
            assert out.shape == (len(lengths) * G, 6)
        graphs[layers] = (counted.frame_count, counters["stats"]["unique_graphs"])
    assert graphs == {2: (1, 1), 8: (1, 1)}


def test_a_model_of_another_layout_decodes_as_graphs_would_and_says_so_once(
    counted, monkeypatch, capsys
):
    # Gemma scales its embeddings by sqrt(hidden): not the Llama layout FusedStep spells out. It
    # decodes as --decode graphs would (on the CPU: eagerly), the same tokens, said once.
    from transformers import GemmaConfig, GemmaForCausalLM

    monkeypatch.setattr(decode.FusedStep, "warned", False)
    config = GemmaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GemmaForCausalLM(config).eval()
    assert not decode.fused_layout(model) and decode.fused_layout(small_model("qwen2-gqa"))
    ids, mask = left_padded([5, 3])
    outs = []
    for fused in (False, True, True):
        torch.manual_seed(2)
        settings = sampling.Sampling(max_new_tokens=8, fused=fused)
        outs.append(decode.plain_decode(model, ids, mask, settings, 2, [-1], 0))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("warning: the fused decode runs the decoder")
    assert "GemmaForCausalLM: decoding eagerly" in err and counted.frame_count == 0


def test_decode_fused_is_asked_for_runs_on_the_cpu_and_refuses_what_graphs_refuses():
    import argparse

    def resolved(**flags):
        base = dict(device="cuda", decode="fused", compile=None, fsdp=False, num_beams=1)
        args = argparse.Namespace(**{**base, **flags})
        config.resolve_decode(args)
        return args.decode

    assert resolved() == "fused" and resolved(device="cpu") == "fused"
    assert resolved(decode="auto") == "fused"  # CUDA's default since the fifth GPU lease
    said = {}
    for flags in (dict(compile="inductor"), dict(fsdp=True), dict(num_beams=4)):
        with pytest.raises(config.UserError) as stop:
            resolved(**flags)
        said[next(iter(flags))] = str(stop.value)
    assert said["compile"].startswith("--decode fused does not combine with --compile")
    assert "no decode loop to compile with --fsdp" in said["fsdp"]
    assert "--num-beams" in said["num_beams"]
    args = config.parse_args([*CPU, "--demo", "--decode", "fused", "--output-dir", "x"])
    assert args.decode == "fused" and sampling.Sampling.of(args).fused


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_cuda_the_fused_step_is_compiled_then_captured_and_draws_the_eager_tokens(
    backend, monkeypatch
):
    # On CUDA GraphStep captures FusedStep: compiled in the warm-up step, then captured, the
    # replays running no Python (the embedding's pre-hook sees 3 forwards: prefill, warm-up,
    # capture), no fallback said. aot_eager runs the eager kernels: the eager decode's tokens, as
    # graphs' (tests/test_sampling.py). Inductor keeps fp32 intermediates where eager rounds each
    # op to bf16: each row's tokens are the eager ones up to its first difference, if any, and
    # there the drawn log-probs are within 0.1 (the compiled decode's bound, test_precision.py).
    torch._dynamo.reset()
    monkeypatch.setattr(decode, "FUSED_BACKEND", backend)
    monkeypatch.setattr(decode.GraphStep, "warned", False)
    model = small_model("llama").cuda()
    model.lm_head.register_forward_hook(lambda m, i, out: [out[..., demo.EOS].add_(1.5)] and None)
    forwards = []
    model.model.embed_tokens.register_forward_pre_hook(lambda m, a: forwards.append(1))
    ids, mask = (x.cuda() for x in left_padded([5, 1, 8, 3]))
    outs = []
    for fused in (False, True):
        settings = sampling.Sampling(temperature=0.9, max_new_tokens=16, fused=fused)
        torch.manual_seed(3)
        forwards.clear()
        with sampling.autocast("cuda", torch.bfloat16):
            outs.append(decode_with_drawn_logprobs(model, ids, mask, settings, 3, [demo.EOS], 0))
    assert len(forwards) == 3 and not decode.GraphStep.warned
    (eager, eager_logps), (fused, fused_logps) = outs
    if backend == "aot_eager":
        assert torch.equal(fused, eager)
    same = (fused == eager).long().cumprod(1).bool()  # each row up to its first difference
    assert same[:, 0].all() and same.float().mean() > 0.5
    assert ((fused_logps - eager_logps).abs() * same).max() < 0.1
    torch._dynamo.reset()


@pytest.mark.slow
def test_with_inductor_a_demo_run_decodes_the_eager_runs_tokens(tmp_path):
    # Inductor, as a run compiles it (decode.FUSED_BACKEND), on the CPU in fp32: one decode call
    # at the demo's width against the eager one (tokens equal, drawn log-probs within 1e-5: see
    # the docstring), then train.py --demo for 2 steps (16 prompts x G = 8 a step, their rows
    # ending apart), whose metrics.jsonl equals the eager run's, timing aside. Measured: 23 s with
    # a cold inductor cache, 8 s warm.
    import train

    torch._dynamo.reset()
    model = demo.tiny_llama(97, 0).eval()
    model.lm_head.register_forward_hook(lambda m, i, out: [out[..., demo.EOS].add_(1.5)] and None)
    ids, mask = left_padded([5, 1, 8, 3])
    outs = []
    for fused in (False, True):
        settings = sampling.Sampling(temperature=1.0, max_new_tokens=24, fused=fused)
        torch.manual_seed(5)
        outs.append(decode_with_drawn_logprobs(model, ids, mask, settings, 8, [demo.EOS], 0))
    (eager, eager_logps), (fused, fused_logps) = outs
    assert torch.equal(fused, eager)
    difference = (fused_logps - eager_logps).abs().max().item()
    assert difference < 1e-5
    runs = {}
    for how in ("eager", "fused"):
        argv = [*CPU, "--demo", "--steps", "2", "--eval-every", "-1", "--decode", how]
        train.main([*argv, "--output-dir", str(tmp_path / how)])
        runs[how] = without_time(read_metrics(tmp_path / how))
    assert runs["fused"] == runs["eager"] and len(runs["eager"]) == 2
    assert 0 < runs["eager"][0]["frac_truncated"] < 1  # some rows ended before the budget


def test_gpu_check_prints_fused_beside_graphs_and_a_fused_failure_apart(capsys):
    # What the next GPU lease prints (scripts/gpu_check.py, CUDA's fields: a capture per call),
    # from a report of that shape; on the CPU the whole check runs it (not captured there).
    from scripts import gpu_check

    greedy = dict(tokens_equal=6, of=300, max_logit_diff_first_steps=0.0156)
    timing = dict(
        rows=32, prompts=4, prompt_tokens=219, new_tokens=300, cache_length=519,
        eager_ms_per_token=26.91, graphs_ms_per_token=7.27, graphs_first_call_seconds=2.2,
        graphs_capture_seconds=0.05, graphs_greedy=greedy, fused_backend="inductor",
        fused_ms_per_token=5.0, fused_first_call_seconds=31.0, fused_compile_seconds=28.8,
        fused_capture_seconds=0.04, fused_greedy=greedy,
    )  # fmt: skip
    floor = gpu_check.decode_floor(demo.tiny_llama(97, 0), timing, torch.bfloat16, 2e12)
    assert floor["fused_over_floor"] == pytest.approx(5.0 / floor["floor_ms_per_token"])
    report = dict(decode=timing, floor=floor, dtype="bf16")
    gpu_check.print_decode(report)
    (line,) = [s for s in capsys.readouterr().out.splitlines() if s.lstrip().startswith("fused")]
    assert "5.00 ms/token" in line and "compiled in 28.8 s once per process" in line
    assert "capture 0.04 s per call" in line and "6 of 300 tokens equal" in line
    # fused is CUDA's default: the run's first decode compiled the layer, not the check's call
    gpu_check.print_decode(dict(report, decode=dict(timing, fused_compile_seconds=None)))
    (line,) = [s for s in capsys.readouterr().out.splitlines() if s.lstrip().startswith("fused")]
    assert "compiled once per process, by the run's first decode; capture 0.04 s" in line
    del timing["fused_ms_per_token"]
    gpu_check.print_decode(dict(report, decode=dict(timing, fused_error="RuntimeError: no")))
    assert "  fused     FAILED (RuntimeError: no)" in capsys.readouterr().out.splitlines()


@pytest.fixture
def fresh_dynamo():
    """dynamo reset before the test and after it, whatever the test did."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def broken_compiler(gm, example_inputs):
    """A torch.compile backend that fails as inductor does on a machine without a C compiler."""
    broken_compiler.calls += 1
    raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")


@pytest.mark.parametrize("captured", [False, True], ids=["cpu", "captured-as-on-cuda"])
def test_a_fused_compile_that_fails_decodes_eagerly_with_one_warning(
    captured, monkeypatch, capsys, fresh_dynamo
):
    # fused is CUDA's default, and inductor needs Triton and a C compiler there: a compile that
    # fails must not end the run. Dynamo raises before the first layer runs, so the step is redone
    # by the eager step from an unwritten cache: the tokens of --decode eager (graphs, captured),
    # bit for bit, from the same random numbers; said once, and never compiled again.
    monkeypatch.setattr(decode, "FUSED_BACKEND", broken_compiler)
    monkeypatch.setattr(decode.FusedStep, "failed", None)
    monkeypatch.setattr(broken_compiler, "calls", 0, raising=False)
    if captured:  # GraphStep over FusedStep, its graph replayed on the CPU
        monkeypatch.setattr(decode, "uses_graphs", lambda settings, device: True)
        monkeypatch.setattr(decode, "CudaGraph", Replay)
    model = small_model("llama")
    model.lm_head.register_forward_hook(lambda m, i, out: [out[..., demo.EOS].add_(1.5)] and None)
    ids, mask = left_padded([5, 1, 8, 3])
    outs = []
    for fused in (False, True, True):
        torch.manual_seed(3)
        settings = sampling.Sampling(temperature=0.9, max_new_tokens=12, fused=fused)
        outs.append(decode.plain_decode(model, ids, mask, settings, 3, [demo.EOS], demo.PAD))
        outs.append(torch.rand(1))
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[0], outs[4])
    assert torch.equal(outs[1], outs[3]) and torch.equal(outs[1], outs[5])  # the RNG left alike
    lengths = grpo.completion_mask(outs[0], [demo.EOS]).sum(1)
    assert len(set(lengths.tolist())) >= 3  # rows ended apart: the fixed rows' padding kept
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(
        "warning: the fused decode could not be compiled"
    )
    assert "Failed to find C compiler" in err and "decoding as --decode graphs does" in err
    assert broken_compiler.calls == 1 and decode.FusedStep.failed.startswith(
        "BackendCompilerFailed"
    )


def succeeds_once_then_fails(gm, example_inputs):
    """A backend whose second compile fails: the part of a broken graph after the break."""
    succeeds_once_then_fails.calls += 1
    if succeeds_once_then_fails.calls > 1:
        raise RuntimeError("Failed to find C compiler.")
    return gm.forward


def test_a_graph_break_in_a_layer_falls_back_before_anything_of_it_runs(monkeypatch, capsys):
    # A layer dynamo cannot trace whole (here a hook that breaks the graph before the MLP) is
    # refused while tracing (fullgraph), before any of it runs: the fall-back redoes the step from
    # an unwritten cache, the eager decode's tokens. Without fullgraph dynamo would run the
    # attention's part (the cache written, its position advanced), then compile the rest: were
    # that compile to fail, the eager redo would write the layer's cache twice.
    torch._dynamo.reset()
    monkeypatch.setattr(decode, "FUSED_BACKEND", succeeds_once_then_fails)
    monkeypatch.setattr(decode.FusedStep, "failed", None)
    monkeypatch.setattr(succeeds_once_then_fails, "calls", 0, raising=False)
    model = small_model("llama")
    for layer in model.model.layers:
        layer.mlp.register_forward_pre_hook(lambda m, a: torch._dynamo.graph_break())
    model.lm_head.register_forward_hook(lambda m, i, out: [out[..., demo.EOS].add_(1.5)] and None)
    ids, mask = left_padded([5, 1, 8, 3])
    outs = []
    try:
        for fused in (False, True):
            torch.manual_seed(3)
            settings = sampling.Sampling(temperature=0.9, max_new_tokens=12, fused=fused)
            outs.append(decode.plain_decode(model, ids, mask, settings, 3, [demo.EOS], demo.PAD))
    finally:
        torch._dynamo.reset()
    assert torch.equal(outs[0], outs[1])
    assert succeeds_once_then_fails.calls == 0  # refused while tracing: nothing compiled, or run
    assert decode.FusedStep.failed.startswith("Unsupported")
    assert "warning: the fused decode could not be compiled (Unsupported" in capsys.readouterr().err


def test_an_error_past_the_compile_is_raised_not_hidden(monkeypatch):
    # Only dynamo's own errors raised before the first layer runs fall back: one at the second
    # layer (the first has written its cache) ends the call, as would any error of the model's.
    monkeypatch.setattr(decode.FusedStep, "failed", None)
    calls = []

    def fails_at_the_second_layer(layer, *args):
        calls.append(1)
        if len(calls) == 2:
            raise torch._dynamo.exc.InternalTorchDynamoError("a recompile at layer 1")
        return decode._layer_step(layer, *args)

    monkeypatch.setattr(decode, "fused_layer", lambda backend: fails_at_the_second_layer)
    ids, mask = left_padded([5, 3])
    settings = sampling.Sampling(max_new_tokens=4, fused=True)
    with pytest.raises(torch._dynamo.exc.InternalTorchDynamoError, match="a recompile at layer 1"):
        decode.plain_decode(small_model("llama"), ids, mask, settings, 2, [-1], demo.PAD)
    assert len(calls) == 2 and decode.FusedStep.failed is None


def test_the_fused_decode_of_a_lora_model_draws_the_eager_tokens(counted, monkeypatch):
    # fused is CUDA's default, --lora-rank too may run it: the layers it compiles hold LoRA's
    # adapters, traced as any other module (FusedStep runs the base model's layers). Captured as on
    # CUDA, under bf16 autocast: the eager decode's tokens, bit for bit, with aot_eager.
    peft = pytest.importorskip("peft")
    monkeypatch.setattr(decode, "uses_graphs", lambda s, device: s.graphs or s.fused)
    monkeypatch.setattr(decode, "CudaGraph", Replay)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
    model = peft.get_peft_model(small_model("llama"), lora).get_base_model().eval()
    with torch.no_grad():  # B = 0 at init: the adapters would change nothing
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    assert decode.fused_layout(model)
    ids, mask = left_padded([5, 1, 8, 3])
    outs = []
    for fused in (False, True):
        torch.manual_seed(3)
        settings = sampling.Sampling(temperature=0.9, max_new_tokens=12, fused=fused)
        with sampling.autocast("cpu", torch.bfloat16):
            outs.append(decode.plain_decode(model, ids, mask, settings, 3, [demo.EOS], demo.PAD))
    assert torch.equal(outs[0], outs[1]) and counted.frame_count == 1
    torch.manual_seed(3)  # and the adapters did change the tokens
    with sampling.autocast("cpu", torch.bfloat16):
        plain = decode.plain_decode(
            small_model("llama"), ids, mask, settings, 3, [demo.EOS], demo.PAD
        )
    assert not torch.equal(plain, outs[0])


WORDS = ["<pad>", "<eos>", "<unk>", "q", "<tool>", "</tool>", "<result>", "</result>", "calc"]
WORDS += ["12", "x", "y"]


def scripted_around_the_layers(model, next_word):
    """Make `model` write next_word[previous word] (a logit of 50 on it, 0 elsewhere; <eos> after
    any other word) through hooks on the embedding and the lm-head, which FusedStep runs itself
    (tests/helpers.py's scripted() hooks the model's forward, which a fused step never calls)."""
    seen = {}
    ids_of = {w: i for i, w in enumerate(WORDS)}

    def remember(module, args):
        seen["ids"] = args[0]

    def write(module, args, out):
        nxt = [ids_of[next_word.get(WORDS[i], "<eos>")] for i in seen["ids"][:, -1].tolist()]
        logits = torch.zeros_like(out)
        logits[torch.arange(len(nxt)), -1, torch.tensor(nxt)] = 50.0
        return logits

    model.model.embed_tokens.register_forward_pre_hook(remember)
    model.lm_head.register_forward_hook(write)


def test_tools_in_the_loop_force_the_same_tokens_through_the_fused_decode(counted, monkeypatch):
    # --tool and --env on CUDA decode fused by default: a forced result token is data for the
    # compiled step as for the eager one. The scripted exchange of tests/test_tools.py, captured
    # as on CUDA: "sampled 3 tokens, forced 4, sampled 2", the same rows, masks and forced flags.
    import tools

    monkeypatch.setattr(decode, "uses_graphs", lambda s, device: s.graphs or s.fused)
    monkeypatch.setattr(decode, "CudaGraph", Replay)
    script = {"q": "<tool>", "<tool>": "calc", "calc": "</tool>", "</result>": "12", "12": "<eos>"}
    model, tok = demo.tiny_llama(len(WORDS), 0).eval(), demo.word_tokenizer(WORDS)
    scripted_around_the_layers(model, script)
    runs = []
    for fused in (False, True):
        toolbox = tools.Tools({"calc": lambda arguments: "12 12"})
        settings = sampling.Sampling(1.0, 0, 1.0, 12, fused=fused)
        runs.append(sampling.sample_rollouts(model, tok, ["q"], settings, 2, tools=toolbox))
    eager, fused = runs
    words = "<tool> calc </tool> <result> 12 12 </result> 12 <eos>".split()
    assert fused.input_ids[0, fused.prompt_length :].tolist() == [WORDS.index(w) for w in words]
    assert torch.equal(fused.input_ids, eager.input_ids)
    assert torch.equal(fused.completion_mask, eager.completion_mask)
    assert fused.completion_mask[0].tolist() == [1, 1, 1, 0, 0, 0, 0, 1, 1]
    assert torch.equal(fused.forced, eager.forced) and counted.frame_count == 1


def test_gpu_check_reports_a_fused_decode_that_fell_back_as_a_failure(monkeypatch):
    # The run decodes fused by default: where its compile failed, the process decodes as graphs,
    # and the check must not time that as fused (it would print graphs' numbers on fused's line).
    from scripts import gpu_check

    monkeypatch.setattr(decode.FusedStep, "failed", "BackendCompilerFailed: no C compiler")
    opts = type("Opts", (), {"compile_backend": "inductor"})()

    def generate(mode):
        raise AssertionError("nothing may be timed")

    out = gpu_check.fused_check(None, None, None, None, 8, [1], None, None, opts, None, generate)
    assert out["fused_error"] == (
        "RuntimeError: the fused decode fell back to graphs: BackendCompilerFailed: no C compiler"
    )
    assert decode.FUSED_BACKEND == "inductor"  # given back
