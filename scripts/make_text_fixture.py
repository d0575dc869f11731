#!/usr/bin/env python3
"""Write a Llama-style model folder with a real tokenizer, and what Hugging Face makes of a
text prompt in it, so `tpc run --prompt TEXT` can be checked token for token.

Writes ``tests/fixtures/text/llama/``:

* ``model.safetensors``: the weights of ``tests/fixtures/checkpoints/llama-gqa`` (copied
  byte for byte: the same tiny random Llama, see scripts/make_fixtures.py);
* ``config.json``: that model's config with ``bos_token_id: 1`` and ``eos_token_id: 2``, as a
  Llama-2 checkpoint has them;
* ``generation_config.json``: ``eos_token_id`` a list, ``[2, X]``, where X is a token the
  greedy continuation of the prompt reaches after a few steps, so generation stops there
  (this exercises "any id of the list stops");
* ``tokenizer.json``: a byte-pair tokenizer trained here on a small English corpus, laid out
  as Llama-2's is (``<unk>``, ``<s>``, ``</s>`` as ids 0, 1, 2; normalizer Prepend("▁") +
  Replace(" ", "▁"); BPE with byte fallback; a TemplateProcessing post-processor that puts
  ``<s>`` first);
* ``tokenizer_config.json``: as transformers 4.x saved Llama-2 / TinyLlama / Mistral ones
  (``add_bos_token: true``, ``add_eos_token: false``, ``tokenizer_class: LlamaTokenizer``),
  with Llama-2-chat's ``chat_template``;
* ``text_reference.json``: the prompt text, the ids ``AutoTokenizer`` makes of it with its
  default special tokens, the new ids of greedy ``model.generate`` (which reads
  ``generation_config.json``), their text (``decode(..., skip_special_tokens=True)``), the
  smallest top-1/top-2 logit gap over the steps, and the versions used.

The tokenizer, model and generation settings are read back from the folder as a user's
``AutoTokenizer.from_pretrained`` / ``AutoModelForCausalLM.from_pretrained`` would.

Run from the repository root, after scripts/make_fixtures.py (versions pinned in
scripts/requirements-fixtures.txt):

    python3 scripts/make_text_fixture.py
"""

from __future__ import annotations

import json
import os
import platform
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import tokenizers
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "tests" / "fixtures" / "checkpoints" / "llama-gqa"
OUT = ROOT / "tests" / "fixtures" / "text" / "llama"
COMMAND = "python3 scripts/make_text_fixture.py"

VOCAB = 250  # the model's vocabulary
PROMPT = "the quick cat sat on the red stone by the river"
MAX_NEW = 12  # the reference asks for this many; the EOS list stops it earlier
MIN_GREEDY_MARGIN = 0.1  # as make_fixtures.py: no near-ties for float noise to flip
MIN_STEPS_BEFORE_EOS = 4

CORPUS = """
the quick brown fox jumps over the lazy dog by the river bank
a small cat sat on the red stone and looked at the blue sky
the old man walked down the long road to the town in the morning
she read a good book about the sea and the ships that sail on it
they went to the city on the train and came back by car at night
the king and the queen lived in a large house near the green field
the child drew a picture of the sun, the moon and the stars
we can see the light of the fire from the window of the house
the teacher told the students a story about a bird and a fish
in the winter the water of the river is cold and the trees are bare
my friend the doctor works in the north of the country with the farmers
music and song filled the evening while the people danced in the square
every spring the birds come back and build their nests under the roof
""".strip().splitlines()


def train_tokenizer() -> Tokenizer:
    """A Llama-2-shaped BPE tokenizer of VOCAB ids, trained on CORPUS."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    # Training splits at spaces (merges stay inside words, as SentencePiece's do); the saved
    # tokenizer has Llama-2's layout: no pre-tokenizer, "▁" prepended and for every space.
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    assert [tok.token_to_id(t) for t in ("<unk>", "<s>", "</s>")] == [0, 1, 2]
    tok.pre_tokenizer = None
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0",
        pair="<s>:0 $A:0 <s>:1 $B:1",
        special_tokens=[("<s>", 1)],
    )
    return tok


def added_token(content: str) -> dict:
    return {
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }


# Llama-2-chat's template as published (bos/eos strings, raise_exception, `.strip()`), for
# `tpc serve`'s /v1/chat/completions.
CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{%"
    " set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = "
    "messages %}{% set system_message = false %}{% endif %}{% for message in loop_mes"
    "sages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_e"
    "xception('Conversation roles must alternate user/assistant/user/assistant/...') "
    "}}{% endif %}{% if loop.index0 == 0 and system_message != false %}{% set content"
    " = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}{% els"
    "e %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'u"
    "ser' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message"
    "['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif"
    " %}{% endfor %}"
)

TOKENIZER_CONFIG = {
    "add_bos_token": True,
    "add_eos_token": False,
    "added_tokens_decoder": {str(i): added_token(t) for i, t in enumerate(["<unk>", "<s>", "</s>"])},
    "bos_token": "<s>",
    "chat_template": CHAT_TEMPLATE,
    "clean_up_tokenization_spaces": False,
    "eos_token": "</s>",
    "legacy": False,
    "model_max_length": 128,
    "pad_token": None,
    "padding_side": "right",
    "sp_model_kwargs": {},
    "tokenizer_class": "LlamaTokenizer",
    "unk_token": "<unk>",
}


def write_model(eos: list[int] | None) -> None:
    """The llama-gqa weights with Llama-2's special-token ids; `eos` for generation."""
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    shutil.copyfile(SOURCE / "model.safetensors", OUT / "model.safetensors")
    cfg = LlamaConfig.from_pretrained(SOURCE)
    cfg.bos_token_id, cfg.eos_token_id = 1, 2
    cfg.save_pretrained(OUT)
    gen = {"bos_token_id": 1, "eos_token_id": eos if eos is not None else 2}
    gen["transformers_version"] = transformers.__version__
    (OUT / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    train_tokenizer().save(str(OUT / "tokenizer.json"))
    (OUT / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")


@torch.no_grad()
def generate(max_new: int, **kwargs):
    """What a user's from_pretrained + generate gives: prompt ids, new ids, step logits."""
    tok = AutoTokenizer.from_pretrained(OUT)
    model = AutoModelForCausalLM.from_pretrained(OUT, attn_implementation="eager").float().eval()
    ids = tok(PROMPT, return_tensors="pt").input_ids
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new,
        pad_token_id=0,  # one sequence, no padding; silences the warning
        output_logits=True,
        return_dict_in_generate=True,
        **kwargs,
    )
    new = out.sequences[0, ids.shape[1]:].tolist()
    logits = torch.stack([x[0] for x in out.logits]).float()
    return tok, ids[0].tolist(), new, logits


def margin(logits: torch.Tensor) -> float:
    top = logits.topk(2, dim=-1).values
    return float((top[:, 0] - top[:, 1]).min())


def main() -> None:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()

    # First without a stop list, to pick a stop id the continuation reaches.
    write_model(eos=None)
    _, _, free, _ = generate(MAX_NEW, eos_token_id=None)
    stop = next(
        (t for i, t in enumerate(free) if i >= MIN_STEPS_BEFORE_EOS and t not in free[:i] and t != 2),
        None,
    )
    assert stop is not None, f"no new token after step {MIN_STEPS_BEFORE_EOS} in {free}"

    write_model(eos=[2, stop])
    tok, prompt_ids, new, logits = generate(MAX_NEW)
    assert prompt_ids[0] == 1 and prompt_ids.count(1) == 1, f"expected one <s> first: {prompt_ids}"
    assert new[-1] == stop and len(new) < MAX_NEW, f"generation did not stop at {stop}: {new}"
    assert 0 not in prompt_ids, f"the prompt has unknown words: {prompt_ids}"
    gap = margin(logits)
    assert gap >= MIN_GREEDY_MARGIN, f"top-1/top-2 gap {gap:.3f} < {MIN_GREEDY_MARGIN}"

    reference = {
        "description": "Llama-2-style tokenizer and stop list; HF's ids for a text prompt",
        "command": COMMAND,
        "transformers_version": transformers.__version__,
        "tokenizers_version": tokenizers.__version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "tokenizer_class": type(tok).__name__,
        "prompt": PROMPT,
        "prompt_ids": prompt_ids,
        "prompt_ids_without_special_tokens": tok(PROMPT, add_special_tokens=False).input_ids,
        "max_new_tokens": MAX_NEW,
        "eos_token_id": [2, stop],
        "generated_ids": new,
        "generated_text": tok.decode(new, skip_special_tokens=True),
        "min_greedy_top1_top2_margin": round(gap, 4),
    }
    (OUT / "text_reference.json").write_text(json.dumps(reference, indent=2) + "\n")
    print(json.dumps(reference, indent=2))


if __name__ == "__main__":
    main()
