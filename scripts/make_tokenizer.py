"""Writes a tiny word-level tokenizer.json (250 tokens, matching the fixtures' vocab) into
the llama-gqa reference checkpoint, so `tpc run --prompt "text"` can be tested.

    python3 scripts/make_tokenizer.py
"""
from tokenizers import Tokenizer, models, pre_tokenizers, decoders

WORDS = (
    "the a an of to in and is was for on that with as by at from it this be are or his "
    "her they we you he she not but have has had one all were which when there their what "
    "so if out up about who into more can will time would no than other some could them "
    "these two may then do first any my now such like our over man me even most made after "
    "also did many before must through back years where much your way well down should "
    "because each just those people how too little state good very make world still own see "
    "men work long get here between both life being under never day same another know while "
    "last might us great old year off come since against go came right used take three "
    "cat dog bird fish tree house river stone cloud rain sun moon star light dark red blue "
    "green small large quick slow happy sad water fire earth wind road city town field "
    "door window table chair book page word line story song music voice hand eye head heart "
    "mind dream night morning evening winter summer spring autumn north south east west "
    "king queen child friend teacher student doctor farmer king2 ship train car plane"
).split()

vocab = {"<unk>": 0}
for w in WORDS:
    if w not in vocab and len(vocab) < 250:
        vocab[w] = len(vocab)
i = 0
while len(vocab) < 250:
    vocab[f"tok{i}"] = len(vocab)
    i += 1

tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
tok.save("tests/fixtures/checkpoints/llama-gqa/tokenizer.json")
print(tok.encode("the quick cat sat on the red stone").ids)
print(tok.decode(tok.encode("the quick cat on the red stone").ids))
