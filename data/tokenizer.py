"""The GPT-2 tokenizer, built offline from the BPE files shipped in data/gpt2_bpe/.

`get_tokenizer()` returns a tiktoken Encoding equal to `tiktoken.get_encoding("gpt2")` (same merges,
same split pattern, same special token) without touching the network. The BPE files are checked
against the sha256 that tiktoken itself pins for them, so a damaged copy fails loudly instead of
tokenising wrongly.
"""

import functools
import hashlib
from pathlib import Path

EOT = 50256  # <|endoftext|>: prepended to every document in a shard
VOCAB_SIZE = 50257  # ids 0..50256; anything larger in a shard is corruption

BPE_DIR = Path(__file__).resolve().parent / "gpt2_bpe"
BPE_SHA256 = {
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}
# GPT-2's pre-tokenisation regex, for tiktoken releases that do not export it as r50k_pat_str.
_R50K_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def check_bpe_files(bpe_dir=BPE_DIR):
    """Raise if a BPE file is missing or its sha256 is not the one tiktoken pins for GPT-2."""
    for name, expected in BPE_SHA256.items():
        path = Path(bpe_dir) / name
        if not path.is_file():
            raise FileNotFoundError(f"GPT-2 BPE file missing: {path}")
        actual = hashlib.sha256(path.read_bytes()).hexdigest()
        if actual != expected:
            raise ValueError(
                f"GPT-2 BPE file {path} is damaged or not the GPT-2 one: "
                f"sha256 {actual}, expected {expected}"
            )


@functools.cache
def get_tokenizer():
    """The GPT-2 tiktoken Encoding (50257 tokens, <|endoftext|> = 50256), built once per process."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    try:
        from tiktoken_ext.openai_public import r50k_pat_str as pattern
    except ImportError:
        pattern = _R50K_PATTERN

    check_bpe_files()
    files = dict(
        vocab_bpe_file=str(BPE_DIR / "vocab.bpe"), encoder_json_file=str(BPE_DIR / "encoder.json")
    )
    try:  # passing the hashes makes tiktoken re-check its own on-disk cache of these files
        ranks = data_gym_to_mergeable_bpe_ranks(
            **files,
            vocab_bpe_hash=BPE_SHA256["vocab.bpe"],
            encoder_json_hash=BPE_SHA256["encoder.json"],
        )
    except TypeError:  # tiktoken < 0.6 has no hash arguments
        ranks = data_gym_to_mergeable_bpe_ranks(**files)
    enc = tiktoken.Encoding(
        name="gpt2",
        pat_str=pattern,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": EOT},
        explicit_n_vocab=VOCAB_SIZE,
    )
    return enc
