"""GGUF, llama.cpp's model format, in one place: the file reader with its config and tokenizer (`file.py`),
the block-quantized types and their dequantization math (`quants.py`), the pairing of a file's tensors with
a transformers model's weights (`weights.py`) and the conversion to Hugging Face folders (`converter.py`).

`file.py` and `quants.py` import nothing of Strata, so every level may use them (the GGUF layers in
`hw_agnostic/layers/gguf.py` compute with `quants.py`); `weights.py` sits at the models' level and
`converter.py` above `strata.converters`, whose folder writer it uses.
"""
