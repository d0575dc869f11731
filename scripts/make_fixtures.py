#!/usr/bin/env python3
"""Generate tiny reference checkpoints with Hugging Face transformers.

For every case in CASES this writes ``tests/fixtures/checkpoints/<case>/``:

* whatever ``model.save_pretrained`` writes (``config.json``, ``model.safetensors``,
  ``generation_config.json``): a real HF checkpoint directory, safetensors only;
* ``reference.safetensors`` with
  - ``prompt_ids``    int64   [prompt_len]          the fixed prompt,
  - ``logits``        float32 [prompt_len, vocab]   prefill logits of the prompt,
  - ``greedy_ids``    int64   [n_new]               HF greedy continuation
                                                    (``generate(do_sample=False)``),
  - ``greedy_logits`` float32 [n_new, vocab]        the logits each greedy token was
                                                    chosen from (step i's row is the
                                                    prediction after prompt + i tokens);
* ``reference.json``: versions, prompt, n_new, seed, the command, and the statistics the
  checks below measured.

All references are computed from the checkpoint *as reloaded from disk* with
``attn_implementation="eager"`` in float32 math (the bf16 case loads its bf16 weights and
upcasts them with ``model.float()``, so its reference is exactly the bf16 weights in f32).

Random weights: HF's default init (std 0.02) makes every block of a tiny model nearly the
identity, so a runtime that dropped a layer would still match.  ``init_weights`` re-draws
every parameter so that each attention and each MLP changes the logits noticeably, and
``check_model`` asserts it (skipping any layer, or zeroing any attention or MLP output,
moves the logits by a relative norm > MIN_REL_CHANGE), that logits are finite and spread
out, and that greedy decoding does not collapse to one token.  A case whose first seed fails
a check tries the next seed (deterministically); the seed used is recorded.

Mixture-of-experts cases (Mixtral, Qwen3-MoE, Qwen2-MoE, OLMoE): transformers 5.x holds each
layer's experts fused (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]) and
``save_pretrained`` writes them back per expert (``mlp.experts.{j}.gate_proj.weight`` ...,
Mixtral's ``block_sparse_moe.experts.{j}.w1/w2/w3.weight``); ``check_moe_reload`` checks the
reload is bit-identical to the saved model.  Experts run with ``experts_implementation="eager"``
(a plain loop over experts).  Router weights are drawn with ROUTER_GAIN so that routing is not
trivial; ``routing_stats`` records, per MoE layer, which experts the prompt and the greedy tokens
picked and the smallest gap between the top_k-th and (top_k+1)-th router probability and logit,
and a seed is rejected if a layer uses fewer than MIN_EXPERTS_USED experts, if one expert takes
every token, or if a gap is below MIN_ROUTER_PROB_GAP / MIN_ROUTER_LOGIT_GAP (a near-tie that
rounding could flip).  The ablations also zero Qwen2-MoE's routed experts and shared expert, drop
its shared-expert sigmoid gate, and flip norm_topk_prob where the family has the flag.

Determinism: fixed seeds, weights drawn from a private ``torch.Generator`` on CPU,
``torch.use_deterministic_algorithms(True)``, one CPU thread, float32 math throughout.

Regenerate (from the repository root; versions pinned in scripts/requirements-fixtures.txt):

    pip install -r scripts/requirements-fixtures.txt
    python3 scripts/make_fixtures.py            # all cases
    python3 scripts/make_fixtures.py gpt2       # only the named cases
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # quiet save/load progress bars

import numpy as np
import safetensors
import torch
import transformers
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    MixtralConfig,
    OlmoeConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "tests" / "fixtures" / "checkpoints"
COMMAND = "python3 scripts/make_fixtures.py"

# ---------------------------------------------------------------------------------------
# Shared shape and prompts
# ---------------------------------------------------------------------------------------

HIDDEN = 64
HEADS = 8
LAYERS = 2
# 250 is deliberately not a multiple of 4 or 8: tp=4 and tp=8 must pad the vocabulary.
VOCAB = 250
MAX_POS = 128
N_NEW = 8

# Fixed prompts.  Ids are spread over the whole vocabulary so that, once the vocab is split
# over ranks, every shard (including the last, padded one: id 249) is looked up.
PROMPT_7 = [3, 71, 249, 130, 12, 188, 64]
# 24 tokens for the llama3-scaled case: positions past original_max_position_embeddings=16
# so the llama3 frequency scaling changes the result.
PROMPT_24 = [
    3, 71, 249, 130, 12, 188, 64, 201, 5, 97, 160, 33,
    222, 118, 46, 175, 9, 240, 83, 150, 27, 199, 111, 58,
]

# Checks (see check_model).
MIN_REL_CHANGE = 1e-2  # skipping a layer / zeroing a sublayer must move logits this much
MIN_VOCAB_STD = 0.1  # std of the logits across the vocab, every position
MIN_DISTINCT_GREEDY = 4  # greedy continuation must not collapse into a loop of 1-3 tokens
MIN_GREEDY_MARGIN = 0.1  # top-1 minus top-2 logit at every greedy step (no near-ties)
MAX_SEED_TRIES = 50
# Mixture-of-experts routing (see routing_stats).
MIN_EXPERTS_USED = 5  # every MoE layer routes some token to at least 5 of its 8 experts
MIN_ROUTER_PROB_GAP = 1e-4  # top_k-th minus (top_k+1)-th router probability, every token
MIN_ROUTER_LOGIT_GAP = 1e-3  # the same gap between router logits


def common_eos_free() -> dict:
    """No special tokens: generate() must never stop early nor mask an EOS logit."""
    return dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


# ---------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------


def llama_gqa() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POS,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        **common_eos_free(),
    )


def llama_bf16() -> LlamaConfig:
    cfg = llama_gqa()
    cfg.num_key_value_heads = 4
    return cfg


def llama3_scaled() -> LlamaConfig:
    # transformers 5.x keeps rope_theta inside rope_parameters; 4.x took rope_scaling.
    # Passing both spellings works on either.
    rope = dict(
        rope_type="llama3",
        rope_theta=10000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=16,
    )
    cfg = llama_gqa()
    if hasattr(cfg, "rope_parameters"):
        return LlamaConfig(**{**cfg.to_diff_dict(), "rope_parameters": rope})
    return LlamaConfig(**{**cfg.to_diff_dict(), "rope_scaling": rope})


def qwen2_bias() -> Qwen2Config:
    # Qwen2 always has q/k/v biases (o_proj has none).
    return Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POS,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        use_sliding_window=False,
        **common_eos_free(),
    )


def qwen3_tied() -> Qwen3Config:
    # head_dim 16 with 8 heads: q_proj is 64 -> 128, o_proj 128 -> 64 (heads*head_dim != hidden).
    return Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=MAX_POS,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        use_sliding_window=False,
        **common_eos_free(),
    )


def gpt2() -> GPT2Config:
    return GPT2Config(
        vocab_size=VOCAB,
        n_embd=HIDDEN,
        n_head=HEADS,
        n_layer=LAYERS,
        n_positions=MAX_POS,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
        **common_eos_free(),
    )


def neox_parallel() -> GPTNeoXConfig:
    # head_dim 8, rotary_pct 0.25 -> 2 rotary dims per head.
    return GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_hidden_layers=LAYERS,
        intermediate_size=256,
        max_position_embeddings=MAX_POS,
        rotary_pct=0.25,
        rotary_emb_base=10000.0,
        use_parallel_residual=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        **common_eos_free(),
    )


def mixtral_moe() -> MixtralConfig:
    # 8 experts of 128 features (intermediate_size is the expert size), 2 per token; Mixtral
    # always renormalises the top-2 probabilities.  head_dim = 64 / 8 = 8.
    return MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POS,
        rope_theta=10000.0,
        num_local_experts=8,
        num_experts_per_tok=2,
        router_jitter_noise=0.0,
        sliding_window=None,
        tie_word_embeddings=False,
        **common_eos_free(),
    )


def qwen3_moe() -> Qwen3MoeConfig:
    # 3 layers, layer 1 dense (mlp_only_layers) with intermediate 192; layers 0 and 2 have 8
    # experts of 128 features, 2 per token, renormalised.  Qwen3 attention: head_dim 16, per-head
    # q/k RMSNorm.  transformers 5.x writes the expert count as num_local_experts; CONFIG_RENAMES
    # puts back the published spelling (num_experts), which the reload must honour.
    return Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=192,
        num_hidden_layers=3,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=MAX_POS,
        rope_theta=10000.0,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        decoder_sparse_step=1,
        tie_word_embeddings=False,
        use_sliding_window=False,
        **common_eos_free(),
    )


def qwen2_moe() -> Qwen2MoeConfig:
    # q/k/v biases; 8 experts of 128, 2 per token, NOT renormalised; plus a shared expert of 192
    # scaled by sigmoid(shared_expert_gate(x)).  intermediate_size would size dense layers (none).
    return Qwen2MoeConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=192,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POS,
        rope_theta=10000.0,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=192,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
        use_sliding_window=False,
        **common_eos_free(),
    )


def olmoe() -> OlmoeConfig:
    # q_norm / k_norm are RMSNorms over the whole q (64) and k (4 kv heads * 8 = 32) projections,
    # before the split into heads; 8 experts of 128, 2 per token, NOT renormalised.
    return OlmoeConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=4,  # every tp from 1 to 4 gathers q and k in runs
        max_position_embeddings=MAX_POS,
        rope_theta=10000.0,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        clip_qkv=None,
        attention_bias=False,
        tie_word_embeddings=False,
        **common_eos_free(),
    )


# name -> (config factory, save dtype, prompt, base seed, one-line description)
CASES = {
    "llama-gqa": (llama_gqa, torch.float32, PROMPT_7, 1000,
                  "Llama, 8 q heads / 2 kv heads (GQA), f32, untied lm_head"),
    "llama-bf16": (llama_bf16, torch.bfloat16, PROMPT_7, 2000,
                   "Llama, 4 kv heads, weights stored in bfloat16"),
    "llama3-scaled": (llama3_scaled, torch.float32, PROMPT_24, 3000,
                      "Llama with llama3 rope scaling (factor 8, original max 16), 24-token prompt"),
    "qwen2-bias": (qwen2_bias, torch.float32, PROMPT_7, 4000,
                   "Qwen2: q/k/v biases, 2 kv heads, intermediate 96, untied"),
    "qwen3-tied": (qwen3_tied, torch.float32, PROMPT_7, 5000,
                   "Qwen3: tied embeddings, head_dim 16 (heads*head_dim=128 != hidden 64), q/k RMSNorm"),
    "gpt2": (gpt2, torch.float32, PROMPT_7, 6000,
             "GPT-2: tied, Conv1D [in, out] weights, fused c_attn, learned positions, gelu_new"),
    "neox-parallel": (neox_parallel, torch.float32, PROMPT_7, 7000,
                      "GPT-NeoX: fused per-head query_key_value, partial rotary 0.25, parallel residual, untied"),
    "mixtral-moe": (mixtral_moe, torch.float32, PROMPT_7, 8000,
                    "Mixtral: 8 experts of 128, top-2 renormalised, block_sparse_moe w1/w2/w3, 2 kv heads"),
    "qwen3-moe": (qwen3_moe, torch.float32, PROMPT_7, 9000,
                  "Qwen3-MoE: 3 layers, layer 1 dense (mlp_only_layers), 8 experts of 128, top-2 renormalised, head_dim 16"),
    "qwen2-moe": (qwen2_moe, torch.float32, PROMPT_7, 10000,
                  "Qwen2-MoE: q/k/v biases, 8 experts of 128, top-2 not renormalised, sigmoid-gated shared expert of 192"),
    "olmoe": (olmoe, torch.float32, PROMPT_7, 11000,
              "OLMoE: q/k RMSNorm over the whole projections, 8 experts of 128, top-2 not renormalised"),
}

# config.json keys renamed after save_pretrained, so that the fixture carries the spelling of the
# published checkpoints.  transformers 5.x's Qwen3MoeConfig maps num_experts onto
# num_local_experts and writes the latter; Qwen/Qwen3-30B-A3B's config.json says num_experts.
CONFIG_RENAMES = {
    "qwen3-moe": {"num_local_experts": "num_experts"},
}


# ---------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------

EMBED_STD = 0.5  # token (and GPT-2 position) embeddings
LINEAR_GAIN = 2.0  # Linear / Conv1D weights: std = gain / sqrt(fan_in)
LM_HEAD_GAIN = 3.0  # untied lm_head: logits std of about 3
BIAS_STD = 0.2
NORM_W_STD = 0.1  # norm weights = 1 + 0.1 N(0,1)
NORM_B_STD = 0.1  # LayerNorm biases
# MoE router weights: std = gain / sqrt(hidden).  The router sees an RMS-normed input, so its
# logits have a std of about ROUTER_GAIN: distinct experts win for distinct tokens, and the
# top_k-th and (top_k+1)-th logits are well apart.  A larger gain separates the logits more but
# makes the (top_k+1)-th probability tiny, which shrinks the probability gap (both are checked,
# see routing_stats); 3 passes both for most seeds.
ROUTER_GAIN = 3.0


def is_norm(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.LayerNorm) or "RMSNorm" in type(module).__name__


def is_experts(module: torch.nn.Module) -> bool:
    """A fused collection of MoE experts (transformers 5.x ``*Experts``)."""
    return type(module).__name__.endswith("Experts") and hasattr(module, "gate_up_proj")


def is_router(module: torch.nn.Module) -> bool:
    """An MoE router (transformers 5.x ``*TopKRouter``): weight [num_experts, hidden]."""
    return type(module).__name__.endswith("TopKRouter")


def init_weights(model: torch.nn.Module, seed: int) -> None:
    """Re-draw every parameter from a private generator (independent of torch's global RNG)."""
    gen = torch.Generator().manual_seed(seed)
    done: set[int] = set()  # tied parameters are drawn once

    def draw(p: torch.nn.Parameter, mean: float, std: float) -> None:
        if id(p) in done:
            return
        done.add(id(p))
        with torch.no_grad():
            p.copy_(mean + std * torch.randn(p.shape, generator=gen, dtype=torch.float32))

    for name, module in model.named_modules():
        kind = type(module).__name__
        if is_experts(module):
            # transformers 5.x keeps the experts fused: gate_up_proj [E, 2I, H] (gate rows then up
            # rows, each [out, in] like nn.Linear) and down_proj [E, H, I].
            draw(module.gate_up_proj, 0.0, LINEAR_GAIN / math.sqrt(module.gate_up_proj.shape[-1]))
            draw(module.down_proj, 0.0, LINEAR_GAIN / math.sqrt(module.down_proj.shape[-1]))
        elif is_router(module):
            draw(module.weight, 0.0, ROUTER_GAIN / math.sqrt(module.weight.shape[-1]))
        elif isinstance(module, torch.nn.Embedding):
            draw(module.weight, 0.0, EMBED_STD)
        elif is_norm(module):
            draw(module.weight, 1.0, NORM_W_STD)
            if getattr(module, "bias", None) is not None:
                draw(module.bias, 0.0, NORM_B_STD)
        elif isinstance(module, torch.nn.Linear) or kind == "Conv1D":
            # nn.Linear stores [out, in]; GPT-2's Conv1D stores [in, out].
            fan_in = module.weight.shape[0] if kind == "Conv1D" else module.weight.shape[1]
            head = name.split(".")[-1] in ("lm_head", "embed_out")
            gain = LM_HEAD_GAIN if head else LINEAR_GAIN
            draw(module.weight, 0.0, gain / math.sqrt(fan_in))
            if module.bias is not None:
                draw(module.bias, 0.0, BIAS_STD)

    missed = [n for n, p in model.named_parameters() if id(p) not in done]
    assert not missed, f"parameters left at HF's init: {missed}"


# ---------------------------------------------------------------------------------------
# Model structure helpers (for the ablation checks)
# ---------------------------------------------------------------------------------------


def decoder_layers(model) -> torch.nn.ModuleList:
    for path in ("model.layers", "transformer.h", "gpt_neox.layers"):
        obj = model
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
            return obj
        except AttributeError:
            continue
    raise RuntimeError(f"no decoder layers found in {type(model).__name__}")


def sublayer(layer, names) -> torch.nn.Module:
    for n in names:
        if hasattr(layer, n):
            return getattr(layer, n)
    raise RuntimeError(f"none of {names} in {type(layer).__name__}")


def attn_of(layer):
    return sublayer(layer, ("self_attn", "attn", "attention"))


def mlp_of(layer):
    return sublayer(layer, ("mlp",))


def moe_of(layer):
    """The layer's sparse MoE block, or None for a dense MLP.  In transformers 5.x every family
    here calls it ``mlp`` (Mixtral's checkpoint name block_sparse_moe is renamed on load), with
    ``gate`` (router) and ``experts``; Qwen2-MoE adds ``shared_expert`` and ``shared_expert_gate``."""
    mlp = mlp_of(layer)
    if hasattr(mlp, "gate") and is_router(mlp.gate) and hasattr(mlp, "experts"):
        return mlp
    return None


def _replace_first(output, new):
    """Decoder layers / attention return a tensor or a tuple whose first item is the output."""
    if isinstance(output, tuple):
        return (new,) + tuple(output[1:])
    return new


def skip_hook(module, args, kwargs, output):
    """Make a decoder layer the identity: its output is its input hidden states."""
    hidden_in = args[0] if args else kwargs["hidden_states"]
    return _replace_first(output, hidden_in)


def zero_hook(module, args, output):
    first = output[0] if isinstance(output, tuple) else output
    return _replace_first(output, torch.zeros_like(first))


def saturate_hook(module, args, output):
    """Qwen2-MoE's shared_expert_gate logit -> 30, so sigmoid(gate) = 1: the gate is dropped."""
    return torch.full_like(output, 30.0)


class flipped_norm_topk_prob:
    """Context: every router with a norm_topk_prob flag computes with the opposite setting."""

    def __init__(self, model):
        self.routers = [m for m in model.modules() if is_router(m) and hasattr(m, "norm_topk_prob")]

    def __enter__(self):
        for r in self.routers:
            r.norm_topk_prob = not r.norm_topk_prob
        return self

    def __exit__(self, *exc):
        for r in self.routers:
            r.norm_topk_prob = not r.norm_topk_prob
        return False


class RouterRecorder:
    """Context: record every router call's logits and chosen experts, per MoE layer."""

    def __init__(self, model):
        self.model = model
        self.calls: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.top_k: dict[int, int] = {}
        self.handles = []

    def __enter__(self):
        for i, layer in enumerate(decoder_layers(self.model)):
            moe = moe_of(layer)
            if moe is None:
                continue
            self.calls[i] = []
            self.top_k[i] = moe.gate.top_k

            def hook(module, args, output, i=i):
                router_logits, _scores, indices = output
                self.calls[i].append((router_logits.detach().float().clone(), indices.detach().clone()))

            self.handles.append(moe.gate.register_forward_hook(hook))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return False


# ---------------------------------------------------------------------------------------
# Reference computation and checks
# ---------------------------------------------------------------------------------------


@torch.no_grad()
def prefill_logits(model, ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids[None], attention_mask=torch.ones_like(ids)[None], use_cache=False)
    return out.logits[0].float()


def rel_change(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@torch.no_grad()
def ablations(model, ids: torch.Tensor, base: torch.Tensor) -> dict:
    """Relative change of the prompt logits when each layer / sublayer is removed."""
    result = {}
    for i, layer in enumerate(decoder_layers(model)):
        for what, module, register in (
            ("skip_layer", layer, lambda m: m.register_forward_hook(skip_hook, with_kwargs=True)),
            ("zero_attn", attn_of(layer), lambda m: m.register_forward_hook(zero_hook)),
            ("zero_mlp", mlp_of(layer), lambda m: m.register_forward_hook(zero_hook)),
        ):
            handle = register(module)
            try:
                result[f"{what}_{i}"] = rel_change(prefill_logits(model, ids), base)
            finally:
                handle.remove()
        moe = moe_of(layer)
        if moe is not None and hasattr(moe, "shared_expert"):
            # Qwen2-MoE: the routed experts, the shared expert and its sigmoid gate each matter.
            for what, module, hook in (
                ("zero_routed_experts", moe.experts, zero_hook),
                ("zero_shared_expert", moe.shared_expert, zero_hook),
                ("drop_shared_expert_gate", moe.shared_expert_gate, saturate_hook),
            ):
                handle = module.register_forward_hook(hook)
                try:
                    result[f"{what}_{i}"] = rel_change(prefill_logits(model, ids), base)
                finally:
                    handle.remove()
    flip = flipped_norm_topk_prob(model)
    if flip.routers:
        # norm_topk_prob true or false: a runtime that got it the other way round must not match.
        with flip:
            result["flip_norm_topk_prob"] = rel_change(prefill_logits(model, ids), base)
    return result


@torch.no_grad()
def greedy(model, ids: torch.Tensor, n_new: int):
    """HF greedy generation (with KV cache), plus the per-step logits it chose from."""
    out = model.generate(
        input_ids=ids[None],
        attention_mask=torch.ones_like(ids)[None],
        do_sample=False,
        max_new_tokens=n_new,
        min_new_tokens=n_new,
        eos_token_id=None,
        pad_token_id=0,  # only silences the "no pad token" warning; one sequence, no padding
        output_logits=True,
        return_dict_in_generate=True,
    )
    new_ids = out.sequences[0, ids.numel():]
    step_logits = torch.stack([x[0] for x in out.logits]).float()
    assert new_ids.numel() == n_new, f"generate stopped early: {new_ids.tolist()}"
    return new_ids, step_logits


@torch.no_grad()
def greedy_no_cache(model, ids: torch.Tensor, n_new: int) -> torch.Tensor:
    """Plain argmax loop re-running the whole sequence each step: cross-checks generate()."""
    seq = ids.clone()
    for _ in range(n_new):
        nxt = prefill_logits(model, seq)[-1].argmax()
        seq = torch.cat([seq, nxt[None]])
    return seq[ids.numel():]


def routing_stats(prefill: RouterRecorder, gen: RouterRecorder) -> tuple[list[str], dict]:
    """Routing of the reference computations: ``prefill`` recorded the prompt prefill, ``gen``
    generate() (its prompt prefill, then one row per decode step: prompt_len + n_new - 1 tokens).
    Per MoE layer: how often each expert was picked over gen's tokens, how many experts were
    picked at all, and over every router row of both the smallest gap between the top_k-th and
    the (top_k+1)-th router probability (softmax in float32, as every family here computes it)
    and logit.  A small gap is a near-tie that rounding could flip between implementations."""
    fails = []
    layers = {}
    for i, calls in gen.calls.items():
        k = gen.top_k[i]
        n_tokens = sum(c[1].shape[0] for c in calls)
        chosen_prompt = torch.cat([c[1] for c in prefill.calls[i]]).sort(dim=-1).values
        if not torch.equal(chosen_prompt, calls[0][1].sort(dim=-1).values):
            fails.append(f"layer {i}: prompt routing differs between prefill and generate()")
        calls = prefill.calls[i] + calls
        router_logits = torch.cat([c[0] for c in calls])  # [rows, num_experts]
        chosen = torch.cat([c[1] for c in calls])  # [rows, top_k]
        n_experts = router_logits.shape[1]
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        p_sorted = probs.sort(dim=-1, descending=True).values
        l_sorted = router_logits.sort(dim=-1, descending=True).values
        prob_gap = float((p_sorted[:, k - 1] - p_sorted[:, k]).min())
        logit_gap = float((l_sorted[:, k - 1] - l_sorted[:, k]).min())
        # HF's choice is the top-k of the probabilities (as a set)
        mine = probs.topk(k, dim=-1).indices.sort(dim=-1).values
        if not torch.equal(mine, chosen.sort(dim=-1).values):
            fails.append(f"layer {i}: router indices are not the top-{k} probabilities")
        counts = torch.bincount(chosen[-n_tokens:].reshape(-1), minlength=n_experts)  # gen's tokens
        used = int((counts > 0).sum())
        layers[str(i)] = {
            "tokens": n_tokens,
            "expert_counts": counts.tolist(),
            "experts_used": used,
            "min_topk_prob_gap": prob_gap,
            "min_topk_logit_gap": logit_gap,
        }
        if used < MIN_EXPERTS_USED:
            fails.append(f"layer {i}: only {used} of {n_experts} experts ever picked")
        if int(counts.max()) >= n_tokens:
            fails.append(f"layer {i}: expert {int(counts.argmax())} picked by every token")
        if prob_gap < MIN_ROUTER_PROB_GAP or logit_gap < MIN_ROUTER_LOGIT_GAP:
            fails.append(f"layer {i}: near-tie in routing: top-k gap {prob_gap:.2e} in probability,"
                         f" {logit_gap:.2e} in logit")
    stats = {
        "moe_layers": [int(i) for i in layers],
        "per_layer": layers,
        "min_experts_used": min(v["experts_used"] for v in layers.values()),
        "max_expert_share": max(max(v["expert_counts"]) / v["tokens"] for v in layers.values()),
        "min_topk_prob_gap": min(v["min_topk_prob_gap"] for v in layers.values()),
        "min_topk_logit_gap": min(v["min_topk_logit_gap"] for v in layers.values()),
    }
    return fails, stats


def check_model(model, ids, logits, new_ids, step_logits, routing=()) -> tuple[list[str], dict]:
    """Return (failures, stats).  An empty failure list means the case is usable."""
    fails = []
    stats = {}
    if not torch.isfinite(logits).all() or not torch.isfinite(step_logits).all():
        fails.append("non-finite logits")
    vocab_std = logits.std(dim=-1)
    stats["logits_shape"] = list(logits.shape)
    stats["logits_std"] = float(logits.std())
    stats["logits_abs_max"] = float(logits.abs().max())
    stats["min_vocab_std_per_position"] = float(vocab_std.min())
    if vocab_std.min() <= MIN_VOCAB_STD:
        fails.append(f"degenerate logits: min std across vocab {float(vocab_std.min()):.4f}")
    # distinct argmax over prompt positions: the model is not predicting one token everywhere
    stats["distinct_prefill_argmax"] = len(set(logits.argmax(-1).tolist()))

    abl = ablations(model, ids, logits)
    stats["ablation_rel_change"] = abl
    stats["min_ablation_rel_change"] = min(abl.values())
    for k, v in abl.items():
        if not v > MIN_REL_CHANGE:
            fails.append(f"{k} changes logits by only {v:.2e}")

    distinct = len(set(new_ids.tolist()))
    stats["distinct_greedy_tokens"] = distinct
    if distinct < MIN_DISTINCT_GREEDY:
        fails.append(f"greedy collapsed: {new_ids.tolist()}")
    top2 = step_logits.topk(2, dim=-1).values
    margin = float((top2[:, 0] - top2[:, 1]).min())
    stats["min_greedy_top1_top2_margin"] = margin
    if margin < MIN_GREEDY_MARGIN:
        fails.append(f"near-tie in greedy decoding: margin {margin:.2e}")

    # consistency of HF's own paths
    if not torch.allclose(step_logits[0], logits[-1], rtol=1e-4, atol=1e-4):
        fails.append("first greedy step logits != last prefill row")
    if not torch.equal(new_ids, greedy_no_cache(model, ids, new_ids.numel())):
        fails.append("generate() (KV cache) disagrees with the no-cache argmax loop")

    if routing and routing[0].calls:
        route_fails, stats["routing"] = routing_stats(*routing)
        fails += route_fails
    return fails, stats


# ---------------------------------------------------------------------------------------
# One case
# ---------------------------------------------------------------------------------------


def impl_kwargs(cfg) -> dict:
    """Eager attention always; for MoE models also the eager experts loop (a plain per-expert
    gate/up/down; transformers 5.x would otherwise pick torch's grouped_mm where it can)."""
    kw = {"attn_implementation": "eager"}
    if getattr(cfg, "num_experts_per_tok", None):
        kw["experts_implementation"] = "eager"
    return kw


def build(cfg, seed: int):
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, **impl_kwargs(cfg))
    init_weights(model, seed)
    model.eval()
    return model


def load(case_dir: Path, save_dtype: torch.dtype, cfg):
    """Reload the written checkpoint; bf16 weights are upcast so all math is float32."""
    model = AutoModelForCausalLM.from_pretrained(case_dir, dtype=save_dtype, **impl_kwargs(cfg))
    for p in model.parameters():
        assert p.dtype == save_dtype, f"{p.dtype} != {save_dtype}"
    model = model.float().eval()
    model.generation_config.eos_token_id = None
    return model


def rope_scaling_matters(model, cfg, ids, logits) -> float:
    """For llama3-scaled: the same weights without rope scaling must give other logits."""
    plain = llama_gqa()
    plain.num_key_value_heads = cfg.num_key_value_heads
    other = AutoModelForCausalLM.from_config(plain, attn_implementation="eager", dtype=torch.float32)
    other.load_state_dict(model.state_dict())
    other.eval()
    return rel_change(prefill_logits(other, ids), logits)


def rename_config_keys(path: Path, renames: dict) -> None:
    """Rename top-level config.json keys, keeping save_pretrained's formatting (sorted, indent 2)."""
    text = path.read_text()
    cfg = json.loads(text)
    assert json.dumps(cfg, indent=2, sort_keys=True) + "\n" == text, "unexpected config.json format"
    for old, new in renames.items():
        assert old in cfg and new not in cfg, (old, new, sorted(cfg))
        cfg[new] = cfg.pop(old)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def check_moe_reload(model, cfg, saved: dict, case_dir: Path) -> None:
    """The MoE checkpoint on disk has per-expert tensors that transformers 5.x fuses on load
    (and un-fuses in save_pretrained): check that the reload is the model that was saved, that
    config.json's expert count was honoured, and that the file has no fused expert tensors."""
    n_experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    routers = [m for m in model.modules() if is_router(m)]
    assert routers and all(r.weight.shape[0] == n_experts for r in routers), "expert count lost"
    loaded = model.state_dict()
    assert sorted(loaded) == sorted(saved), "reloaded parameter names differ"
    for k, v in saved.items():
        assert torch.equal(loaded[k].float(), v), f"{k} changed in the save/load round trip"
    with safetensors.safe_open(str(case_dir / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    fused = [n for n in names if n.endswith(("gate_up_proj", "experts.down_proj"))]
    assert not fused, f"fused expert tensors on disk: {fused}"
    per_expert = [n for n in names if ".experts." in n]
    assert len(per_expert) == 3 * n_experts * len(routers), f"per-expert tensors: {len(per_expert)}"


def make_case(name: str) -> dict:
    factory, save_dtype, prompt, base_seed, what = CASES[name]
    case_dir = OUT_DIR / name
    ids = torch.tensor(prompt, dtype=torch.int64)

    for seed in range(base_seed, base_seed + MAX_SEED_TRIES):
        torch.manual_seed(seed)  # HF's own init before ours; irrelevant but fixed
        cfg = factory()
        model = build(cfg, seed)

        # Write exactly what save_pretrained writes (cleaning anything left from before).
        if case_dir.exists():
            shutil.rmtree(case_dir)
        case_dir.mkdir(parents=True)
        model.to(save_dtype).save_pretrained(case_dir)
        if name in CONFIG_RENAMES:
            rename_config_keys(case_dir / "config.json", CONFIG_RENAMES[name])
        moe = getattr(cfg, "num_experts_per_tok", None) is not None
        saved = {k: v.float().clone() for k, v in model.state_dict().items()} if moe else None
        del model

        # Every reference comes from the checkpoint as it is on disk.
        model = load(case_dir, save_dtype, cfg)
        if moe:
            check_moe_reload(model, cfg, saved, case_dir)
        with RouterRecorder(model) as prefill_routing:
            logits = prefill_logits(model, ids)
        with RouterRecorder(model) as greedy_routing:
            new_ids, step_logits = greedy(model, ids, N_NEW)
        routing = (prefill_routing, greedy_routing)
        fails, stats = check_model(model, ids, logits, new_ids, step_logits, routing)
        if name == "llama3-scaled":
            d = rope_scaling_matters(model, cfg, ids, logits)
            stats["rope_scaling_rel_change"] = d
            if not d > MIN_REL_CHANGE:
                fails.append(f"rope scaling changes logits by only {d:.2e}")
        if not fails:
            break
        print(f"  {name}: seed {seed} rejected: {'; '.join(fails)}", file=sys.stderr)
    else:
        raise SystemExit(f"{name}: no seed in {MAX_SEED_TRIES} tries passed the checks")

    assert not (case_dir / "pytorch_model.bin").exists()
    tensors = {
        "prompt_ids": ids.contiguous(),
        "logits": logits.contiguous(),
        "greedy_ids": new_ids.to(torch.int64).contiguous(),
        "greedy_logits": step_logits.contiguous(),
    }
    save_file(tensors, str(case_dir / "reference.safetensors"), metadata={"format": "pt"})

    info = {
        "case": name,
        "description": what,
        "command": COMMAND,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "safetensors_version": safetensors.__version__,
        "numpy_version": np.__version__,
        "python_version": platform.python_version(),
        "seed": seed,
        "weights_dtype": str(save_dtype).replace("torch.", ""),
        "math_dtype": "float32",
        "attn_implementation": "eager",
        "prompt_ids": prompt,
        "prompt_len": len(prompt),
        "n_new": N_NEW,
        "greedy_ids": new_ids.tolist(),
        "tensors": {k: {"dtype": str(v.dtype).replace("torch.", ""), "shape": list(v.shape)}
                    for k, v in tensors.items()},
        "stats": stats,
    }
    (case_dir / "reference.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def main() -> None:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()

    names = sys.argv[1:] or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; known: {list(CASES)}")
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for name in names:
        info = make_case(name)
        s = info["stats"]
        size = sum(f.stat().st_size for f in (OUT_DIR / name).iterdir())
        print(
            f"{name:14s} seed {info['seed']}  logits {s['logits_shape']} std {s['logits_std']:.3f}"
            f"  min ablation {s['min_ablation_rel_change']:.3f}"
            f"  margin {s['min_greedy_top1_top2_margin']:.3f}"
            f"  greedy {info['greedy_ids']}  {size / 1024:.0f} KiB"
        )
        if "routing" in s:
            r = s["routing"]
            print(
                f"{'':14s} routing: experts used {[v['experts_used'] for v in r['per_layer'].values()]}"
                f"  max share {r['max_expert_share']:.2f}"
                f"  min top-k prob gap {r['min_topk_prob_gap']:.2e}"
                f"  logit gap {r['min_topk_logit_gap']:.3f}"
            )


if __name__ == "__main__":
    main()
