"""The tokenizer files of an exported folder: the job's local HF tokenizer as it is, or the toy character vocabulary
(:class:`milehpc.data.tokenizer.CharTokenizer`) as an equivalent ``tokenizers`` fast tokenizer, so that
``AutoTokenizer`` (and SGLang) read the exported folder with the very ids the run trained on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from milehpc.data.tokenizer import SPECIALS, CharTokenizer, HFTokenizer


def char_tokenizer_as_hf(char: CharTokenizer) -> Any:
    """A ``PreTrainedTokenizerFast`` that encodes and decodes like ``char``: a byte-level BPE without merges whose
    vocabulary is the characters (in the byte-level alphabet: a space is "Ġ"), so every character is one token
    with its toy id — also when ``AutoTokenizer`` picks the config's class (``Qwen2Tokenizer`` for a qwen2 model
    rebuilds a byte-level BPE from the vocabulary and merges). The specials are special tokens, and
    ``add_special_tokens=True`` prepends BOS as ``CharTokenizer.encode_prompt`` does."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    # Qwen2Tokenizer's own pipeline (it rebuilds it whatever tokenizer.json says): the same here, so the folder
    # tokenizes alike under either class.
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    pad, bos, eos = SPECIALS
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = {tok if tok in SPECIALS else byte_level.pre_tokenize_str(tok)[0][0]: i for tok, i in char.stoi.items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
                                                 byte_level])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                       special_tokens=[(bos, char.bos_id)])
    # unk = pad: the vocabulary has no unknown token (CharTokenizer refuses an unknown character); naming none
    # would make Qwen2Tokenizer add its own "<|endoftext|>", one token past the model's vocabulary.
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad, bos_token=bos, eos_token=eos, unk_token=pad)


# A vision-language model's processor (image placeholder expansion, pixels, chat template with image parts): copied
# as they are, so that AutoProcessor reads the exported folder as the run's.
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json",
                   "chat_template.jinja", "chat_template.json")


def write_tokenizer(tokenizer: CharTokenizer | HFTokenizer, out: Path) -> list[str]:
    """Write ``tokenizer``'s files (and a vision-language model's processor files) into ``out``; returns the names
    written."""
    import shutil

    before = set(p.name for p in out.iterdir())
    hf = tokenizer.tok if isinstance(tokenizer, HFTokenizer) else char_tokenizer_as_hf(tokenizer)
    hf.save_pretrained(str(out))
    if isinstance(tokenizer, HFTokenizer):
        for name in PROCESSOR_FILES:
            if (src := Path(hf.name_or_path) / name).is_file():
                shutil.copyfile(src, out / name)
    return sorted(set(p.name for p in out.iterdir()) - before)


# Characters of the toy vocabulary only, so that the probe encodes under either kind of tokenizer.
PROBE = "what is 12 + 30? it is 42. sort: [3, 1, 2] -> (1, 2, 3)!  done"


def loads_alike(out: Path, tokenizer: CharTokenizer | HFTokenizer) -> str | None:
    """None when ``AutoTokenizer`` reads the folder ``out`` (config.json included) into a tokenizer that gives the
    run's ids; else the class it picked. transformers 5 picks the class by the config's model type for some types
    (qwen2: ``Qwen2Tokenizer``, which rebuilds Qwen's pre-tokenizer whatever tokenizer.json says)."""
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    same = list(loaded.encode(PROBE, add_special_tokens=False)) == tokenizer.encode(PROBE)
    return None if same else type(loaded).__name__
