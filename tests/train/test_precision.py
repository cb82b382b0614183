"""Tests for lathe.train.precision: verl's precision keys -> the dtypes a model computes, accumulates and updates in."""

import pytest
import torch

from lathe.config import load_config
from lathe.train.precision import FP32, resolve_policy

CUDA = torch.device("cuda")   # resolve_policy only reads the device type: no GPU needed
KEY = "actor_rollout_ref.actor.fsdp_config"


def _fsdp(*overrides):
    return load_config(None, [f"{KEY}.{o}" for o in overrides]).actor_rollout_ref.actor.fsdp_config


def test_verl_defaults_on_cuda_are_bf16_compute_on_fp32_masters_with_fp32_gradients():
    policy = resolve_policy(_fsdp(), CUDA, key=KEY)
    assert (policy.param_dtype, policy.reduce_dtype, policy.master_dtype) == (torch.bfloat16, torch.float32,
                                                                               torch.float32)
    assert policy.mixed and "bf16 compute, fp32 master weights, fp32 gradients" == policy.describe()


def test_a_cpu_run_trains_in_fp32_whatever_the_keys_say():
    assert resolve_policy(_fsdp("mixed_precision.param_dtype=bf16"), torch.device("cpu"), key=KEY) == FP32


def test_a_frozen_model_holds_its_compute_dtype_only():
    policy = resolve_policy(_fsdp(), CUDA, key=KEY, trainable=False)
    assert not policy.mixed and policy.master_dtype == policy.param_dtype == torch.bfloat16


def test_pure_bf16_and_pure_fp32_are_not_mixed():
    bf16 = resolve_policy(_fsdp("model_dtype=bf16"), CUDA, key=KEY)
    fp32 = resolve_policy(_fsdp("mixed_precision.param_dtype=fp32"), CUDA, key=KEY)
    assert not bf16.mixed and bf16.param_dtype == torch.bfloat16
    assert not fp32.mixed and fp32.param_dtype == torch.float32


@pytest.mark.parametrize("overrides, words", [
    (["mixed_precision.param_dtype=fp16"], "mixed_precision.param_dtype=fp16: lathe trains in bf16 or fp32"),
    (["model_dtype=bf16", "mixed_precision.param_dtype=fp32"], "model_dtype=bf16 with"),
    (["mixed_precision.buffer_dtype=bf16"], "buffer_dtype=bf16"),
    (["mixed_precision.reduce_dtype=int8"], "reduce_dtype=int8 is not one of the values this key takes"),
])
def test_combinations_lathe_does_not_implement_are_refused_naming_the_key(overrides, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")) as err:
        resolve_policy(_fsdp(*overrides), CUDA, key=KEY)
    assert KEY in str(err.value) and "Fix" in str(err.value) or "known" in str(err.value)


def test_the_same_policy_as_fsdp2s_mixed_precision_policy():
    mp = resolve_policy(_fsdp(), CUDA, key=KEY).fsdp2_policy()
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.bfloat16, torch.float32)
