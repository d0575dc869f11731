"""tpc from Python: vLLM's offline API over tpc's engine, and tpc's compiler.

    from tpc import LLM, SamplingParams

    llm = LLM("path/to/hf-model-folder", tensor_parallel_size=2)
    for out in llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16)):
        print(out.outputs[0].text)

    plan = tpc.compile("models/llama3-8b.ron", tp=8)
    print(plan.summary())

`LLM` loads the model once (its ranks run as threads of this process, on CPUs or, in a build
with the `cuda` feature, GPUs) and runs every `generate` batch through the same continuous-
batching engine as `tpc serve`, with the same parameter checks and error messages. Generation
releases the GIL; Ctrl-C cancels the batch and raises `KeyboardInterrupt`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Union

from . import _tpc

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "Plan",
    "compile",
    "simulate",
]
__version__ = _tpc.__version__

# vLLM engine arguments that only tune its own memory or kernels: accepted and ignored, so
# that a vLLM script runs unchanged.
_IGNORED_ENGINE_ARGS = frozenset(
    {
        "trust_remote_code",
        "tokenizer_mode",
        "gpu_memory_utilization",
        "swap_space",
        "cpu_offload_gb",
        "enforce_eager",
        "disable_log_stats",
        "disable_custom_all_reduce",
        "max_seq_len_to_capture",
        "compilation_config",
        "disable_async_output_proc",
    }
)


@dataclass
class SamplingParams:
    """vLLM's sampling parameters (its defaults: temperature 1.0, 16 new tokens).

    Supported: temperature, top_p, top_k (-1 or 0: all tokens), seed, stop, stop_token_ids,
    ignore_eos, max_tokens, min_tokens, logprobs. n, best_of and the penalties must keep their neutral
    values; other values are refused with the reason.
    """

    n: int = 1
    best_of: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True

    def _params(self, default_seed: int) -> Dict[str, Any]:
        if self.min_p != 0.0:
            raise ValueError(f"min_p {self.min_p} is not supported by tpc; leave it at 0")
        if self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not supported by tpc; leave it None")
        if not self.skip_special_tokens:
            raise ValueError("skip_special_tokens=False is not supported by tpc; leave it True")
        p: Dict[str, Any] = {
            "n": self.n,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed if self.seed is not None else default_seed,
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
        }
        if self.best_of is not None:
            p["best_of"] = self.best_of
        if self.top_k is not None and self.top_k > 0:
            p["top_k"] = self.top_k
        elif self.top_k is not None and self.top_k < -1:
            raise ValueError(f"top_k {self.top_k}: give -1 or 0 (all tokens) or a positive count")
        if self.max_tokens is not None:
            p["max_tokens"] = self.max_tokens
        if self.stop:
            p["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.stop_token_ids:
            p["stop_token_ids"] = [int(t) for t in self.stop_token_ids]
        if self.logprobs is not None:
            p["logprobs"] = self.logprobs
        return p


@dataclass
class Logprob:
    """One token's log-probability at a generated position, and its rank there (1: the most likely)."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: List[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[List[Dict[int, Logprob]]]
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    outputs: List[CompletionOutput]
    finished: bool = True
    prompt_logprobs: Optional[list] = None


PromptType = Union[str, List[int], Dict[str, Any]]


def _one_prompt(p: Any) -> Dict[str, Any]:
    """A prompt as the engine takes it: text, token ids, or vLLM's prompt dicts."""
    if isinstance(p, str):
        return {"prompt": p}
    if isinstance(p, dict):
        if "prompt_token_ids" in p:
            return {"prompt": [int(t) for t in p["prompt_token_ids"]]}
        if "prompt" in p:
            return {"prompt": str(p["prompt"])}
        raise ValueError("a prompt dict needs `prompt` (text) or `prompt_token_ids` (a list of ids)")
    if isinstance(p, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return {"prompt": [int(t) for t in p]}
    raise TypeError(f"a prompt must be text, a list of token ids or a prompt dict, not {type(p).__name__}")


def _prompts(prompts: Any) -> List[Dict[str, Any]]:
    if isinstance(prompts, (str, dict)):
        return [_one_prompt(prompts)]
    if isinstance(prompts, (list, tuple)):
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [_one_prompt(prompts)]
        return [_one_prompt(p) for p in prompts]
    raise TypeError(f"prompts must be a prompt or a list of prompts, not {type(prompts).__name__}")


class LLM:
    """A model loaded for offline generation, named and shaped as vLLM's `LLM`.

    model: an HF model folder (config.json, model.safetensors, tokenizer.json for text).
    tensor_parallel_size, pipeline_parallel_size, data_parallel_size: the ranks' layout.
    dtype: "auto" (the checkpoint's), "float32" or "bfloat16". device: "cpu", "cuda",
    "cuda:0,1". seed: the seed of every request whose SamplingParams give none (each prompt
    of a call gets seed + its index, so reruns are identical). max_model_len caps the
    context; kv_cache_memory (bytes per rank) sizes the KV cache. tp_shares ("3,1" or
    [3, 1], one per tensor-parallel rank) deals every split dimension by per-rank shares
    for unequal devices (`--tp-shares`). enable_expert_parallel deals a mixture-of-experts
    model's experts over the data_parallel_size replicas (`--ep`).
    """

    def __init__(
        self,
        model: str,
        tokenizer: Optional[str] = None,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        data_parallel_size: int = 1,
        dtype: str = "auto",
        device: str = "cpu",
        seed: int = 0,
        max_model_len: Optional[int] = None,
        max_num_seqs: Optional[int] = None,
        max_num_batched_tokens: Optional[int] = None,
        kv_cache_memory: Optional[int] = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        threads_per_rank: int = 0,
        tp_shares: Union[str, Sequence[int], None] = None,
        enable_expert_parallel: bool = False,
        **kwargs: Any,
    ) -> None:
        unknown = sorted(set(kwargs) - _IGNORED_ENGINE_ARGS)
        if unknown:
            raise TypeError(f"LLM() got arguments tpc does not know: {', '.join(unknown)}")
        if tokenizer is not None and str(tokenizer) != str(model):
            raise ValueError("tpc reads the tokenizer from the model folder; leave `tokenizer` unset")
        self._seed = int(seed)
        self._engine = _tpc.Engine(
            str(model),
            tp=int(tensor_parallel_size),
            pp=int(pipeline_parallel_size) if pipeline_parallel_size != 1 else None,
            dp=int(data_parallel_size),
            device=str(device),
            dtype=str(dtype),
            max_model_len=max_model_len,
            kv_cache_memory=kv_cache_memory,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            block_size=int(block_size),
            enable_prefix_caching=bool(enable_prefix_caching),
            threads_per_rank=int(threads_per_rank),
            tp_shares=_shares(tp_shares),
            enable_expert_parallel=bool(enable_expert_parallel),
        )
        info = json.loads(self._engine.info())
        self.model_name: str = info["name"]
        self.max_model_len: int = info["context"]
        self.layout: str = info["layout"]
        self._next_request = 0

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType], None] = None,
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
        prompt_token_ids: Optional[List[List[int]]] = None,
    ) -> List[RequestOutput]:
        """Generates for every prompt (text, token ids, or {"prompt"} / {"prompt_token_ids"}
        dicts), all at once through the engine; outputs in prompt order."""
        if prompts is None and prompt_token_ids is not None:
            prompts = [{"prompt_token_ids": ids} for ids in prompt_token_ids]
        if prompts is None:
            raise ValueError("give prompts: text, token ids, or a list of them")
        return self._run(_prompts(prompts), sampling_params, use_tqdm)

    def chat(
        self,
        messages: Union[List[Dict[str, Any]], List[List[Dict[str, Any]]]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> List[RequestOutput]:
        """Chat through the model's chat template (tokenizer_config.json): one conversation
        (a list of {"role", "content"}) or a list of them."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        items = [{"messages": list(c), "add_generation_prompt": add_generation_prompt} for c in conversations]
        return self._run(items, sampling_params, use_tqdm)

    def _run(self, items: List[Dict[str, Any]], sampling_params: Any, use_tqdm: bool) -> List[RequestOutput]:
        if sampling_params is None:
            # As vLLM: the model folder's generation defaults (generation_config.json), 16 tokens.
            per_item = [None] * len(items)
        elif isinstance(sampling_params, SamplingParams):
            per_item = [sampling_params] * len(items)
        else:
            per_item = list(sampling_params)
            if len(per_item) != len(items):
                raise ValueError(
                    f"{len(per_item)} SamplingParams for {len(items)} prompts; give one, or one per prompt"
                )
        batch = []
        for k, (item, sp) in enumerate(zip(items, per_item)):
            params = {"max_tokens": 16, "seed": self._seed + k} if sp is None else sp._params(self._seed + k)
            if "add_generation_prompt" in item:
                params["add_generation_prompt"] = item.pop("add_generation_prompt")
            batch.append({**item, "params": params})
        results = json.loads(self._engine.generate(json.dumps(batch), progress=use_tqdm))
        outputs = []
        for item, r in zip(items, results):
            request_id = str(self._next_request)
            self._next_request += 1
            logprobs = None
            cumulative = None
            if r["logprobs"] is not None:
                logprobs = []
                cumulative = 0.0
                for position in r["logprobs"]:
                    entry: Dict[int, Logprob] = {}
                    for rank, (token, text, lp) in enumerate(position["top"], start=1):
                        entry[token] = Logprob(logprob=lp, rank=rank, decoded_token=text)
                    if position["token"] not in entry:
                        entry[position["token"]] = Logprob(logprob=position["logprob"])
                    cumulative += position["logprob"]
                    logprobs.append(entry)
            prompt = item.get("prompt")
            outputs.append(
                RequestOutput(
                    request_id=request_id,
                    prompt=prompt if isinstance(prompt, str) else None,
                    prompt_token_ids=r["prompt_token_ids"],
                    outputs=[
                        CompletionOutput(
                            index=0,
                            text=r["text"],
                            token_ids=r["token_ids"],
                            cumulative_logprob=cumulative,
                            logprobs=logprobs,
                            finish_reason=r["finish_reason"],
                        )
                    ],
                )
            )
        return outputs

    def get_tokenizer(self) -> "_Tokenizer":
        return _Tokenizer(self._engine)

    def close(self) -> None:
        """Stops the engine and its rank threads (also done when the LLM is collected)."""
        self._engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Tokenizer:
    """The model folder's tokenizer, with HF's encode/decode names."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def encode(self, text: str) -> List[int]:
        return self._engine.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._engine.decode([int(t) for t in ids])


class Plan:
    """A compiled plan: its report, its programs, DOT, and how to save it."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._summary = json.loads(inner.summary_json())

    def summary(self) -> str:
        """The report `tpc compile` prints."""
        return self._inner.summary()

    def summary_dict(self) -> Dict[str, Any]:
        """The report as `tpc compile --json` gives it."""
        return dict(self._summary)

    @property
    def collectives(self) -> List[Dict[str, Any]]:
        return list(self._summary["collectives"])

    @property
    def bytes_per_rank(self) -> List[int]:
        """Bytes of parameters each rank holds."""
        return list(self._summary["param_bytes_per_rank"])

    @property
    def tp(self) -> int:
        return int(self._summary["tp"])

    def to_text(self) -> str:
        return self._inner.to_text()

    def to_dot(self) -> str:
        return self._inner.to_dot()

    def save(self, path: str) -> None:
        self._inner.save(str(path))


def _shares(shares: Union[str, Sequence[int], None]) -> Optional[str]:
    """`tp_shares` as `--tp-shares` spells it: "3,1,1,1" or [3, 1, 1, 1]."""
    if shares is None or isinstance(shares, str):
        return shares
    return ",".join(str(int(s)) for s in shares)


def compile(  # noqa: A001 (tpc's name)
    model: str,
    tp: int = 1,
    pp: Optional[int] = None,
    tp_shares: Union[str, Sequence[int], None] = None,
) -> Plan:
    """Compiles a model (.ron, HF folder or config.json) for tp ranks (and pp stages);
    tp_shares ("3,1,1,1" or [3, 1, 1, 1]) deals every split dimension by per-rank shares."""
    return Plan(
        _tpc.compile(str(model), tp=int(tp), pp=None if pp is None else int(pp), tp_shares=_shares(tp_shares))
    )


def simulate(
    model: str,
    tp: int = 1,
    pp: int = 1,
    hw: str = "h100-sxm-nvswitch-8",
    batch: int = 1,
    prompt_len: int = 128,
    gen: int = 128,
    tp_shares: Union[str, Sequence[int], None] = None,
) -> Dict[str, Any]:
    """The cost model's estimate (`tpc simulate --json`) on a hardware profile."""
    return json.loads(
        _tpc.simulate(
            str(model),
            tp=int(tp),
            pp=int(pp),
            hw=str(hw),
            batch=int(batch),
            prompt_len=int(prompt_len),
            gen=int(gen),
            tp_shares=_shares(tp_shares),
        )
    )
