"""One list of the config keys that do not change what a run computes (kdrun.config.NON_IDENTITY_KEYS),
followed by a run's directory name (Hydra's override_dirname), a multirun's directory name
(sweep_name) and the identity that checkpoints are matched against (run_config_hash)."""

from __future__ import annotations

from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from kdrun.config import NON_IDENTITY_KEYS, non_identity_override_keys, register_configs, sweep_name

NEUTRAL = ["logger.mode=offline", "logger.tags=[a,b]", "train.device=cpu", "train.num_threads=1",
           "train.stop_after_steps=3", "report.cost=false", "cache_max_gb=5", "cache_wait_timeout_s=9", "resume=false",
           "run_name=x"]
RESULT = ["task=cola", "seed=3", "train.lr=1e-4"]


def _compose(overrides: list[str]):
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="kdrun.conf", version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=True)


def test_run_directory_name_leaves_out_every_non_identity_key() -> None:
    cfg = _compose([*RESULT, *NEUTRAL])
    assert cfg.hydra.job.override_dirname == "seed=3,task=cola,train.lr=1e-4"
    assert list(cfg.hydra.job.config.override_dirname.exclude_keys) == non_identity_override_keys()


def test_override_keys_expand_each_subtree_of_the_schema() -> None:
    keys = non_identity_override_keys()
    assert {"logger.mode", "logger.grad_shares", "report.cost", "train.device"} <= set(keys)
    assert all(any(k == n or k.startswith(n + ".") for n in NON_IDENTITY_KEYS) for k in keys)
    assert "train.lr" not in keys and "train" not in keys


def test_sweep_name_leaves_out_the_same_keys() -> None:
    assert sweep_name([*RESULT, *NEUTRAL, "hydra.sweep.dir=d"]) == sweep_name(RESULT)
    assert sweep_name([*RESULT, "train.lr=3e-4"]) != sweep_name(RESULT)
    assert sweep_name(["reporting=1", *RESULT]) != sweep_name(RESULT)  # a key, not a prefix of a word


def test_checkpoint_identity_leaves_out_the_same_keys() -> None:
    from kdrun.app.run import run_config_hash

    def resolved(overrides):
        cfg = _compose(overrides)
        return OmegaConf.to_container(cfg, resolve=False) | {"hydra": None}

    base = resolved(RESULT)
    assert run_config_hash(resolved([*RESULT, *NEUTRAL])) == run_config_hash(base)
    assert run_config_hash(resolved([*RESULT, "train.lr=3e-4"])) != run_config_hash(base)
