"""A small offline tokenizer and text dataset for torchtitan's llama3 debug model (its wheel
ships neither, and the tests run offline).

Usage: python make_assets.py OUTDIR
Creates OUTDIR/tokenizer/{tokenizer.json,tokenizer_config.json} (BPE, vocab <= 2048,
the llama3 debugmodel's vocab_size) and OUTDIR/dataset/train.jsonl ({"text": ...} rows,
loadable by datasets.load_dataset(dir, split="train"), i.e. torchtitan's "c4_test" loader).
Fully deterministic: same bytes every run.
"""

from __future__ import annotations

import json
import os
import random
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"

WORDS = [
    "the",
    "a",
    "an",
    "of",
    "to",
    "in",
    "and",
    "is",
    "was",
    "for",
    "on",
    "with",
    "as",
    "by",
    "at",
    "from",
    "that",
    "this",
    "it",
    "be",
    "are",
    "model",
    "train",
    "step",
    "loss",
    "tier",
    "check",
    "point",
    "save",
    "load",
    "shard",
    "rank",
    "data",
    "token",
    "layer",
    "weight",
    "grad",
    "optimizer",
    "state",
    "memory",
    "disk",
    "fast",
    "slow",
    "warm",
    "cold",
    "hot",
    "cache",
    "write",
    "read",
    "block",
    "page",
    "file",
    "store",
    "local",
    "remote",
    "node",
    "device",
    "cpu",
    "gpu",
    "batch",
    "epoch",
    "seed",
]


def make_texts(n_docs: int = 400, seed: int = 1234) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        sents = []
        for _ in range(rng.randint(3, 12)):
            n = rng.randint(5, 16)
            s = " ".join(rng.choice(WORDS) for _ in range(n))
            sents.append(s.capitalize() + rng.choice([".", ".", "!", "?"]))
        docs.append(" ".join(sents))
    return docs


def main(out: str) -> None:
    tok_dir = os.path.join(out, "tokenizer")
    ds_dir = os.path.join(out, "dataset")
    os.makedirs(tok_dir, exist_ok=True)
    os.makedirs(ds_dir, exist_ok=True)
    texts = make_texts()
    with open(os.path.join(ds_dir, "train.jsonl"), "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    assert tok.get_vocab_size() <= 2048, tok.get_vocab_size()
    tok.save(os.path.join(tok_dir, "tokenizer.json"))
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump(
            {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": False},
            f,
            indent=1,
        )
    print(f"vocab={tok.get_vocab_size()} docs={len(texts)} -> {out}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "assets")
