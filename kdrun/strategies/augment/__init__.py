"""TinyBERT-style data augmentation (masked-LM and word-vector candidates), cached as datasets.

``get_augmented(cfg.augmentation, raw_train, task_name, cache_dir, device)`` is what a run calls;
``check_augmentation(cfg.augmentation)`` is its cheap pre-flight. See :mod:`kdrun.strategies.augment.build`.
"""

from kdrun.strategies.augment.build import NO_LABEL, check_augmentation, get_augmented, settings_from_config
from kdrun.strategies.augment.errors import AugmentationError

__all__ = ["NO_LABEL", "AugmentationError", "check_augmentation", "get_augmented", "settings_from_config"]
