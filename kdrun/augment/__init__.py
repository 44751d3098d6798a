"""TinyBERT-style data augmentation (masked-LM and word-vector candidates), cached as datasets."""
