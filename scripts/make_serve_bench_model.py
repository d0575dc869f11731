#!/usr/bin/env python3
"""Write the serving benchmark's checkpoint: TinyLlama-1.1B-shaped bf16 random weights plus a
32000-token tokenizer that vLLM's load generator and both servers can use.

The weights come from ``scripts/make_bench_checkpoint.py`` (standard library only, seeded;
~2.2 GB). The tokenizer is made here, offline, with the ``tokenizers`` package: a word-level
vocabulary of exactly 32000 entries (``<unk>``, ``<s>``, ``</s>`` at 0, 1, 2 as in TinyLlama,
then 31997 distinct lowercase words), split on whitespace, decoded by joining with spaces,
BOS added in front of every prompt (as Llama's tokenizer does).

Why word-level: ``vllm bench serve --dataset-name random`` draws runs of token ids, decodes
them to text, re-encodes that text and sends the text. With a byte-level BPE, decoded runs of
unrelated tokens merge differently on re-encoding, so a "128-token" prompt arrives as some
other length. Here every id decodes to one whitespace-separated word and every word encodes
back to its id, so the round trip is exact and the prompt the servers see has the requested
number of tokens (plus the BOS).

Deterministic: the same files on every run (the word list comes from a seeded generator).
Default output: ``target/bench-model/tinyllama-1.1b-serve`` (git-ignored; never commit it).
Existing weights are kept (``--force`` rewrites them); the tokenizer files are always rewritten.

    python3 scripts/make_serve_bench_model.py            # needs the `tokenizers` package
    python3 scripts/make_serve_bench_model.py --out /tmp/tl --tokenizer-only
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import subprocess
import sys
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

DEFAULT_OUT = "target/bench-model/tinyllama-1.1b-serve"
VOCAB = 32000
SEED = 20261203
SPECIALS = ["<unk>", "<s>", "</s>"]
# Real words first, so chat roles and a few readable prompts tokenize to themselves.
COMMON = (
    "user assistant system the a an of to in and is was for on that with as by at from it "
    "this be are or his her they we you he she not but have has had one all were which when "
    "there their what so if out up about who into more can will time would no than other "
    "some could them these two may then do first any my now like our over me even most made "
    "after also did many before must through back years where much your way well down should "
    "because each just those people how too little state good very make world still own see "
    "hello cat dog bird fish tree house river stone cloud rain sun moon star light dark red "
    "blue green small large quick slow happy sad water fire earth wind road city town field"
).split()
# A chat template over words the vocabulary has (roles are words above), BOS first.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }} "
    "{{ message['content'] }} {% endfor %}{% if add_generation_prompt %}assistant {% endif %}"
)


def words() -> list[str]:
    """31997 distinct lowercase words: the common ones, then made-up syllable words."""
    onsets = "b c d f g h j k l m n p r s t v w z br ch cl dr fl gr pl pr sh st th tr".split()
    vowels = "a e i o u ai ea oo".split()
    codas = ["", "n", "r", "s", "t", "l", "m", "ck"]
    syllables = [o + v + c for o, v, c in itertools.product(onsets, vowels, codas)]
    rng = random.Random(SEED)
    out = list(dict.fromkeys(COMMON))
    seen = set(out) | set(SPECIALS)
    while len(out) < VOCAB - len(SPECIALS):
        w = "".join(rng.choice(syllables) for _ in range(rng.choice((1, 2, 2, 3))))
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


def make_tokenizer() -> Tokenizer:
    vocab = {t: i for i, t in enumerate(SPECIALS + words())}
    assert len(vocab) == VOCAB
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Joins tokens with one space; no clean-up, so every word comes back as it was.
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return tok


TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "add_bos_token": True,
    "add_eos_token": False,
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "model_max_length": 2048,
    "clean_up_tokenization_spaces": False,
    "chat_template": CHAT_TEMPLATE,
}


def check_round_trip(tok: Tokenizer) -> None:
    """A run of consecutive ids (what vLLM's random dataset draws) survives decode+encode."""
    rng = random.Random(SEED)
    for _ in range(20):
        start = rng.randrange(VOCAB)
        ids = [(start + i) % VOCAB for i in range(128)]
        back = tok.encode(tok.decode(ids, skip_special_tokens=False), add_special_tokens=False).ids
        if back != ids:
            raise SystemExit(f"tokenizer round trip broke: {ids[:8]}... -> {back[:8]}...")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--force", action="store_true", help="rewrite the weights too")
    ap.add_argument("--tokenizer-only", action="store_true", help="write only the tokenizer files")
    a = ap.parse_args()
    out = Path(a.out)
    if not a.tokenizer_only:
        # The weights writer renames its finished folder over `out`, so it runs first.
        cmd = [sys.executable, str(Path(__file__).with_name("make_bench_checkpoint.py")), "--out", str(out)]
        subprocess.run(cmd + (["--force"] if a.force else []), check=True)
    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer()
    check_round_trip(tok)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, indent=2) + "\n"
    )
    print(f"{out}: tokenizer of {tok.get_vocab_size()} tokens written (round trip checked)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
