#!/usr/bin/env python3
"""Regenerates tokenizer.json, the small byte-level BPE tokenizer the rackfill-models tests load.

The hub is out of reach from the test machines, so the tests need a real tokenizer.json that is
small enough to commit. This one is built the way Qwen2/Qwen3 tokenizers are (NFC normalizer,
Qwen2 split regex, byte-level pre-tokenizer and decoder, ChatML special tokens appended after the
learned vocabulary), trained on the fixed corpus below, so the output is deterministic.

Usage: python3 make_tokenizer.py   (needs `pip install tokenizers`; writes next to this script)
"""

from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

# Qwen2's pre-tokenization regex (tokenizer.json of Qwen/Qwen2-7B-Instruct).
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.",
    "A mixture of experts routes every token to a few experts out of many.",
    "Prefill processes the whole prompt at once, then decoding produces one token at a time.",
    "The router picks the top experts for each token, and the load on each rank varies a lot.",
    "Hot experts get replicas on idle ranks so that no rank becomes the straggler of the step.",
    "Hello, world! How are you today? I'm fine, thanks. We'll see, they've said, it's done.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159 -7 +12 1e-5.",
    "Code: fn main() { println!(\"hello\"); } def f(x): return x * 2  # comment",
    "<html><body><p>Some markup &amp; entities</p></body></html>",
    "Le café est très chaud, déjà prêt à être servi à la française.",
    "Les élèves ont étudié l'été dernier; où sont-ils allés? Noël, façade, garçon, naïve.",
    "Über die Brücke gehen Müller und Schröder; die Straße ist groß und schön.",
    "El niño comió piña en la montaña; ¿dónde está el señor? ¡Qué día!",
    "Ελληνικά: καλημέρα κόσμε. Русский: привет, мир. Українська: добрий день.",
    "中文：你好，世界。我们今天学习分词器。模型把每个词分成几个子词。",
    "日本語：こんにちは世界。今日は天気がいいですね。トークナイザーのテストです。",
    "한국어: 안녕하세요 세계. 오늘은 좋은 날입니다.",
    "Emoji: 😀 😃 🎉 🚀 👍🏽 ❤️ 🇫🇷 🧪 and text around them 😀🎉.",
    "Tabs\tand\tnewlines\nare whitespace too.\n\n  Indented line.\r\nWindows line.",
]


def main() -> None:
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    # Repeat the corpus so that frequent pairs are well separated from rare ones.
    tokenizer.train_from_iterator(CORPUS * 3, trainer=trainer)
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    out = Path(__file__).resolve().parent / "tokenizer.json"
    tokenizer.save(str(out), pretty=True)
    print(f"wrote {out} (vocab {tokenizer.get_vocab_size(with_added_tokens=True)})")


if __name__ == "__main__":
    main()
