"""Foundry's ``pre_tokenize.py``, with their flags as they are:

    python scripts/pre_tokenize.py --tokenizer models/base/ARWKV-R1-1B5/tokenizer.json \\
        --data oasst1_chat.jsonl --output oasst1_qwen_tokens.bin --max-seq-len 256 \\
        [--split 2 | --split-weights 6,2]

It is ``python -m mlx_rwkvx.pretokenize`` (see there for the rest of its flags).
"""

from mlx_rwkvx.pretokenize import main

if __name__ == "__main__":
    main()
