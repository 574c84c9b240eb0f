"""Trains the embedded default's tokenizer: a small byte-level BPE on data/sources' text, with
ChatML special tokens and the project's strict template (data/tokenizer/chat_template.jinja).

It lets `dflash-etl run` tokenize offline on a fresh machine without any model hub. Run it after
changing data/sources; it is deterministic.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = Path(__file__).resolve().parent
OUT = HERE / "tokenizer"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Markup the template writes; single tokens so masks and reasoning boundaries stay crisp.
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
         "</tool_response>", "<tools>", "</tools>"]
VOCAB_SIZE = 2048


def corpus() -> list[str]:
    sys.path.insert(0, str(HERE.parent / "src"))
    from dflash_etl.core.config import load_config
    from dflash_etl.formats import RowError, normalize_row
    from dflash_etl.io.readers import Unit, read_unit, resolve_paths

    config = load_config(HERE / "pipeline.toml")
    texts = []
    for source in config.sources:
        for path in resolve_paths(source.path, config.base_dir):
            for record in read_unit(Unit(path), 1 << 24):
                if record.value is None:
                    continue
                try:
                    row, _ = normalize_row(record.value, source.format)
                except RowError:
                    continue
                for m in row["messages"]:
                    texts += [m["content"], m["reasoning"] or "", m["tool_calls"] or ""]
                texts.append(row["tools"] or "")
    return [t for t in texts if t]


def main() -> None:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL + ADDED, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus(), trainer)
    OUT.mkdir(exist_ok=True)
    tokenizer.save(str(OUT / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(tokenizer.token_to_id(t)): {"content": t, "special": t in SPECIAL,
                                            "lstrip": False, "rstrip": False,
                                            "normalized": False, "single_word": False}
            for t in SPECIAL + ADDED
        },
    }
    (OUT / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (OUT / "generation_config.json").write_text(
        json.dumps({"eos_token_id": tokenizer.token_to_id("<|im_end|>"),
                    "pad_token_id": tokenizer.token_to_id("<|endoftext|>")}, indent=2) + "\n"
    )
    print(f"vocab {tokenizer.get_vocab_size()} -> {OUT}")


if __name__ == "__main__":
    main()
