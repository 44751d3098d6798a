"""Strategies: training schemes built on the engine — DynaBERT's adaptive widths and depths,
TinyBERT's data augmentation, MGSKD's phrase spans and task-agnostic distillation on raw text."""
