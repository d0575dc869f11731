"""The Python API (`pip install ./python`): vLLM's offline `LLM` / `SamplingParams` over tpc's
engine, and `tpc.compile` / `tpc.simulate`, on the shipped fixtures.

Greedy tokens are checked against Hugging Face transformers' (the fixtures' reference.json and
text_reference.json, which `tpc run` and `tpc serve` reproduce too); chat prompts against the
chat template rendered as transformers renders it (test_openai_client.chat_prompt_ids).

Run: `pytest -q tests/python` in a virtualenv where the package is installed (`.ci/run` does;
there TPC_REQUIRE_PYTHON_API=1 makes a missing package a failure, elsewhere these tests skip).
Every wait is bounded by a timeout so a hang fails; nothing asserts on speed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from test_openai_client import (
    FIXTURE,
    GREEDY_IDS,
    MESSAGES,
    PROMPT_IDS,
    ROOT,
    TEXT_FIXTURE,
    TEXT_REFERENCE,
    TEXT_TOKENIZER,
    TPC_BIN,
    chat_prompt_ids,
)

try:
    import tpc
except ImportError:  # pragma: no cover - CI requires it
    if os.environ.get("TPC_REQUIRE_PYTHON_API") == "1":
        raise
    pytest.skip("the tpc Python package is not installed (pip install ./python)", allow_module_level=True)

from tpc import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8)
TIMEOUT = 120


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def llm(request):
    model = LLM(str(FIXTURE), tensor_parallel_size=request.param)
    yield model
    model.close()


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def text_llm(request):
    model = LLM(str(TEXT_FIXTURE), tensor_parallel_size=request.param)
    yield model
    model.close()


def test_generate_gives_hf_greedy_tokens(llm):
    for prompt in (PROMPT_IDS, {"prompt_token_ids": PROMPT_IDS}, [PROMPT_IDS]):
        [out] = llm.generate(prompt, GREEDY, use_tqdm=False)
        assert out.prompt_token_ids == PROMPT_IDS
        assert out.prompt is None
        [completion] = out.outputs
        assert completion.token_ids == GREEDY_IDS
        assert completion.finish_reason == "length" and completion.finished()


def test_a_ragged_batch_gives_each_prompt_its_tokens_alone(llm):
    prompts = [PROMPT_IDS[:n] for n in (7, 1, 4, 6, 2)] + [PROMPT_IDS * 3]
    lengths = [8, 3, 12, 1, 5, 9]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in lengths]
    together = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in together] == prompts
    for prompt, sp, out in zip(prompts, params, together):
        [alone] = llm.generate(prompt, sp, use_tqdm=False)
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        assert len(out.outputs[0].token_ids) == sp.max_tokens
    assert together[0].outputs[0].token_ids == GREEDY_IDS


def test_seeded_sampling_is_reproducible(llm):
    params = SamplingParams(temperature=1.0, top_k=50, max_tokens=12, seed=7)
    first = llm.generate([PROMPT_IDS] * 3, params, use_tqdm=False)
    again = llm.generate([PROMPT_IDS] * 3, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    # Without a seed in the params, the LLM's seed + the prompt's index: reruns agree too,
    # and prompts of one call differ from each other.
    unseeded = SamplingParams(temperature=1.0, max_tokens=12)
    a = llm.generate([PROMPT_IDS] * 4, unseeded, use_tqdm=False)
    b = llm.generate([PROMPT_IDS] * 4, unseeded, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert len({tuple(o.outputs[0].token_ids) for o in a}) > 1


def test_stop_token_ids_end_generation_with_the_id_returned(llm):
    stop = GREEDY_IDS[3]
    first = GREEDY_IDS.index(stop)
    [out] = llm.generate(PROMPT_IDS, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop]),
                         use_tqdm=False)
    assert out.outputs[0].token_ids == GREEDY_IDS[: first + 1]
    assert out.outputs[0].finish_reason == "stop"
    # min_tokens holds it off; ignore_eos keeps it.
    [held] = llm.generate(PROMPT_IDS, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop],
                                                     min_tokens=8, ignore_eos=True), use_tqdm=False)
    assert held.outputs[0].token_ids == GREEDY_IDS
    with pytest.raises(ValueError, match="stop token id 100000 is outside the vocabulary"):
        llm.generate(PROMPT_IDS, SamplingParams(stop_token_ids=[100000]), use_tqdm=False)


def test_logprobs_name_the_chosen_token_and_the_most_likely(llm):
    [out] = llm.generate(PROMPT_IDS, SamplingParams(temperature=0, max_tokens=4, logprobs=3), use_tqdm=False)
    c = out.outputs[0]
    assert c.token_ids == GREEDY_IDS[:4]
    assert len(c.logprobs) == 4
    for token, position in zip(c.token_ids, c.logprobs):
        assert len(position) == 3
        best = min(position.values(), key=lambda lp: lp.rank)
        assert best.rank == 1 and position[token] is best  # greedy picks the most likely
        assert all(lp.logprob <= 0 for lp in position.values())
    assert c.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(c.token_ids, c.logprobs)))


def test_text_prompts_and_stops_equal_hf(text_llm):
    ref = TEXT_REFERENCE
    [out] = text_llm.generate(ref["prompt"], SamplingParams(temperature=0, max_tokens=ref["max_new_tokens"]),
                              use_tqdm=False)
    assert out.prompt == ref["prompt"]
    assert out.prompt_token_ids == ref["prompt_ids"]
    c = out.outputs[0]
    # Stopped by an id of generation_config.json's eos list: returned, not in the text.
    assert c.token_ids == ref["generated_ids"]
    assert c.text == TEXT_TOKENIZER.decode(ref["generated_ids"][:-1])
    assert c.finish_reason == "stop"
    # A stop string ends the text before it.
    cut = c.text.split()[1]
    [stopped] = text_llm.generate(ref["prompt"], SamplingParams(temperature=0, max_tokens=12, stop=[cut]),
                                  use_tqdm=False)
    assert stopped.outputs[0].finish_reason == "stop"
    assert cut not in stopped.outputs[0].text and c.text.startswith(stopped.outputs[0].text)
    tok = text_llm.get_tokenizer()
    assert tok.encode(ref["prompt"]) == ref["prompt_ids"]


def test_chat_renders_the_chat_template(text_llm):
    [out] = text_llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    prompt_ids = chat_prompt_ids(MESSAGES)
    assert out.prompt_token_ids == prompt_ids
    [same] = text_llm.generate({"prompt_token_ids": prompt_ids}, SamplingParams(temperature=0, max_tokens=8),
                               use_tqdm=False)
    assert out.outputs[0].token_ids == same.outputs[0].token_ids
    assert out.outputs[0].text == same.outputs[0].text
    two = text_llm.chat([MESSAGES, MESSAGES[1:]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert two[0].outputs[0].token_ids == out.outputs[0].token_ids
    assert len(two) == 2


def test_bad_inputs_raise_with_the_servers_messages(llm):
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate(PROMPT_IDS, SamplingParams(max_tokens=0), use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([5, 999999], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="context"):
        llm.generate(PROMPT_IDS * 40, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="`n` is 2"):
        llm.generate(PROMPT_IDS, SamplingParams(n=2), use_tqdm=False)
    with pytest.raises(ValueError, match="repetition_penalty"):
        llm.generate(PROMPT_IDS, SamplingParams(repetition_penalty=1.3), use_tqdm=False)
    with pytest.raises(TypeError, match="not_an_argument"):
        LLM(str(FIXTURE), not_an_argument=1)
    # A tp that does not split the model lists the ones that do, in the CLI's words.
    # (8 query heads: tp 9 would leave a rank without one.)
    with pytest.raises(ValueError) as refused:
        LLM(str(FIXTURE), tensor_parallel_size=9)
    cli = subprocess.run([str(TPC_BIN), "compile", str(FIXTURE), "--tp", "9"], capture_output=True, text=True,
                         timeout=TIMEOUT)
    assert cli.returncode != 0
    assert cli.stderr.strip() == f"error: {refused.value}"
    assert str(refused.value).endswith("Valid tp values for this model: 1, 2, 3, 4, 5, 6, 7, 8.")
    with pytest.raises(ValueError, match="not a model directory"):
        LLM(str(FIXTURE / "config.json"))
    # The engine is still serving after every refusal.
    [out] = llm.generate(PROMPT_IDS, GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == GREEDY_IDS


def test_compile_and_simulate_from_python(tmp_path):
    plan = tpc.compile(str(FIXTURE), tp=2)
    assert plan.tp == 2
    assert len(plan.bytes_per_rank) == 2 and all(b > 0 for b in plan.bytes_per_rank)
    assert plan.collectives[0]["kind"] == "all_reduce"
    assert plan.collectives[0]["bytes_per_token"] == 256  # 64 f32 hidden values per token
    assert plan.summary_dict()["collective_count"] == len(plan.collectives)
    assert "digraph" in plan.to_dot()
    assert plan.to_text().startswith("plan v1 model llama tp=2")
    assert "tp=2" in plan.summary()
    saved = tmp_path / "plan.ron"
    plan.save(str(saved))
    assert saved.stat().st_size > 0
    estimate = tpc.simulate(str(ROOT / "models/llama3-8b.ron"), tp=8, hw="h100-sxm-nvswitch-8")
    assert estimate["tp"] == 8
    with pytest.raises(ValueError, match="Shipped profiles .*h100-sxm-nvswitch-8"):
        tpc.simulate(str(FIXTURE), tp=1, hw="no-such-profile")
    with pytest.raises(ValueError, match="Valid tp values for this model: 1, 2, 3, 4, 5, 6, 7, 8"):
        tpc.compile(str(FIXTURE), tp=9)
    # An uneven tp compiles: the heads are dealt by their kv groups, padded to the largest.
    assert tpc.compile(str(FIXTURE), tp=3).tp == 3


def test_tp_shares_from_python():
    # Rank 1 gets three times rank 0's part of every split dimension (as --tp-shares 1,3).
    for shares in ("1,3", [1, 3]):
        real = tpc.compile(str(FIXTURE), tp=2, tp_shares=shares).summary_dict()["real_param_count_per_rank"]
        assert len(real) == 2 and real[0] < real[1], real
    # An even split pads nothing: the report leaves the per-rank real counts out.
    assert "real_param_count_per_rank" not in tpc.compile(str(FIXTURE), tp=2).summary_dict()
    # The slow rank of a shared split sets its pace: shares toward rank 1 change the estimate.
    a = tpc.simulate(str(ROOT / "models/tinyllama-1.1b.ron"), tp=2, hw="h100-sxm-nvswitch-8")
    b = tpc.simulate(str(ROOT / "models/tinyllama-1.1b.ron"), tp=2, hw="h100-sxm-nvswitch-8", tp_shares=[1, 3])
    assert b["tokens_per_s"]["decode"] < a["tokens_per_s"]["decode"]
    with pytest.raises(ValueError, match="1,2,3 names 3 ranks but tp is 2"):
        tpc.compile(str(FIXTURE), tp=2, tp_shares="1,2,3")
    with pytest.raises(ValueError, match='tp_shares "1,x"'):
        tpc.compile(str(FIXTURE), tp=2, tp_shares="1,x")
    # An engine under shares gives HF's greedy tokens.
    model = LLM(str(FIXTURE), tensor_parallel_size=2, tp_shares=[1, 3])
    try:
        [out] = model.generate(PROMPT_IDS, GREEDY, use_tqdm=False)
        assert out.outputs[0].token_ids == GREEDY_IDS
    finally:
        model.close()


def test_experts_over_replicas_from_python():
    # vLLM's enable_expert_parallel: the MoE fixture's experts dealt over two replicas, each
    # request HF's greedy tokens whichever replica runs it while the other answers.
    moe = ROOT / "tests/fixtures/checkpoints/mixtral-moe"
    reference = json.loads((moe / "reference.json").read_text())
    prompt, want = reference["prompt_ids"], reference["greedy_ids"]
    model = LLM(str(moe), data_parallel_size=2, enable_expert_parallel=True)
    try:
        assert model.layout == "tp=1 pp=1 dp=2 ep=2", model.layout
        params = SamplingParams(temperature=0, max_tokens=len(want))
        outs = model.generate([prompt, prompt[:3], prompt], params, use_tqdm=False)
        assert outs[0].outputs[0].token_ids == want
        assert outs[2].outputs[0].token_ids == want
    finally:
        model.close()


VLLM_QUICKSTART = """
from tpc import LLM, SamplingParams

prompts = [
    {prompt!r},
    {prompt!r},
]
sampling_params = SamplingParams(temperature=0.0, max_tokens=12)
llm = LLM(model={model!r}, tensor_parallel_size=2)
outputs = llm.generate(prompts, sampling_params)
for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {{prompt!r}}, Generated text: {{generated_text!r}}")
"""


def test_a_vllm_quickstart_script_runs_with_only_its_import_changed(tmp_path):
    ref = TEXT_REFERENCE
    script = tmp_path / "quickstart.py"
    script.write_text(VLLM_QUICKSTART.format(prompt=ref["prompt"], model=str(TEXT_FIXTURE)))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr
    want = TEXT_TOKENIZER.decode(ref["generated_ids"][:-1])
    lines = out.stdout.strip().splitlines()
    assert lines == [f"Prompt: {ref['prompt']!r}, Generated text: {want!r}"] * 2


INTERRUPTED = """
import signal, sys, time
from tpc import LLM, SamplingParams
# Python's Ctrl-C handler even where the parent started this with SIGINT ignored (a
# background job of a non-interactive shell), which Python would otherwise keep.
signal.signal(signal.SIGINT, signal.default_int_handler)
llm = LLM({model!r}, tensor_parallel_size=2)
print("generating", flush=True)
try:
    llm.generate([{prompt}] * 12000, SamplingParams(temperature=1.0, max_tokens=120, ignore_eos=True), use_tqdm=False)
except KeyboardInterrupt:
    print("interrupted at", time.monotonic(), flush=True)
    llm.close()
    print("closed", flush=True)
    sys.exit(3)
print("finished", flush=True)
"""


def test_ctrl_c_stops_a_generation_within_a_second(tmp_path):
    script = tmp_path / "interrupted.py"
    script.write_text(INTERRUPTED.format(model=str(FIXTURE), prompt=PROMPT_IDS))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "generating"
        time.sleep(0.5)  # into the batch, which takes several seconds
        assert proc.poll() is None, "the batch finished before it could be interrupted"
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        line = proc.stdout.readline().split()
        assert line[:2] == ["interrupted", "at"], (line, proc.stderr.read())
        assert float(line[2]) - sent < 1.0
        assert proc.stdout.readline().strip() == "closed"
        assert proc.wait(timeout=TIMEOUT) == 3
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
