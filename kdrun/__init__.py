"""kdrun: Hydra-configured task-specific knowledge distillation of BERT-style models on GLUE."""

__version__ = "0.1.0"
