"""`train.kernels`: the one place the trainer, the evaluation and the bench choose device, autocast,
attention kernel and compilation. CUDA and Triton are faked here (the choice is plain logic over
what the device can do); tests/gpu runs the chosen kernels on a real GPU.

Proves: auto takes flex only where its CUDA kernel works (Triton usable, 16 <= head_dim <= 256,
power-of-two head dims before torch 2.6), sdpa otherwise, with the reason; an explicit flex or
compile that cannot work raises ValueError naming the key (model.attention / attention / compile)
and the reason; the choice is logged once (by rank 0 of a data-parallel run, whose ranks each get
the plan for their own GPU); the plan's mask is the kernel's form of the same rule.
"""

from __future__ import annotations

import logging

import pytest
import torch

import train.kernels as K
from train.attention import build_dense_mask
from train.kernels import EVAL_KEYS, TRAIN_KEYS, choose_kernels


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA device with a usable Triton, as far as the choice can see."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(K, "_triton_usable", lambda: True)


def choose(attention="auto", head_dims=(64,), *, device="auto", compile=False, training=True, keys=TRAIN_KEYS):
    return choose_kernels(device, "auto", attention, compile, list(head_dims), training=training, keys=keys)


@pytest.mark.parametrize("head_dim", [16, 64, 128, 256, 48])
def test_auto_takes_flex_on_cuda_where_its_kernel_works(fake_cuda, head_dim):
    plan = choose(head_dims=[head_dim])
    assert (plan.device.type, plan.attention, plan.autocast_dtype) == ("cuda", "flex", torch.bfloat16)
    assert f"head_dim {head_dim}" in plan.reason


def test_auto_falls_back_to_sdpa_on_cuda_with_the_reason(fake_cuda, monkeypatch):
    small = choose(head_dims=[8])
    assert small.attention == "sdpa" and "head_dim >= 16" in small.reason and "has 8" in small.reason
    large = choose(head_dims=[512])
    assert large.attention == "sdpa" and "512 > 256" in large.reason
    assert choose("flex", head_dims=[512]).attention == "flex"  # untuned, not impossible: an explicit choice may try it
    mixed = choose(head_dims=[64, 8], training=False, keys=EVAL_KEYS)  # two checkpoints evaluated together
    assert mixed.attention == "sdpa"
    monkeypatch.setattr(K, "_torch_version", lambda: (2, 5))  # before torch 2.6: power-of-two head dims only
    assert choose(head_dims=[48]).attention == "sdpa" and choose(head_dims=[64]).attention == "flex"
    monkeypatch.setattr(K, "_triton_usable", lambda: False)
    no_triton = choose(head_dims=[64])
    assert no_triton.attention == "sdpa" and "Triton" in no_triton.reason


def test_auto_on_the_cpu_is_sdpa_and_fp32(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    plan = choose(head_dims=[64])
    assert (plan.device.type, plan.attention, plan.autocast_dtype, plan.compile) == ("cpu", "sdpa", None, False)
    assert plan.to_dict() == {
        "device": "cpu",
        "precision": "fp32",
        "attention": "sdpa",
        "compile": False,
        "reason": plan.reason,
    }


def test_an_explicit_flex_that_cannot_work_names_the_key_and_the_reason(fake_cuda, monkeypatch):
    with pytest.raises(
        ValueError, match=r"config key 'model.attention': flex cannot run here: .*head_dim >= 16.*has 8"
    ):
        choose("flex", head_dims=[8])
    with pytest.raises(ValueError, match=r"config key 'attention': flex cannot run here"):  # eval's key
        choose("flex", head_dims=[8], training=False, keys=EVAL_KEYS)
    monkeypatch.setattr(K, "_triton_usable", lambda: False)
    with pytest.raises(ValueError, match=r"'model.attention'.*Triton is not usable"):
        choose("flex", head_dims=[64])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"'model.attention'.*no backward on CPU"):
        choose("flex", head_dims=[64])
    assert choose("flex", head_dims=[64], training=False, keys=EVAL_KEYS).attention == "flex"  # inference only: fine
    assert choose("sdpa", head_dims=[8]).reason == "model.attention=sdpa"


def test_compile_that_cannot_work_names_the_key(fake_cuda, monkeypatch):
    assert choose(compile=True).compile is True
    monkeypatch.setattr(K, "_triton_usable", lambda: False)
    with pytest.raises(ValueError, match=r"config key 'compile': torch.compile cannot work here: .*Triton"):
        choose(attention="sdpa", compile=True)

    import torch._inductor.cpp_builder as cpp_builder

    def no_compiler():
        raise RuntimeError("no working C++ compiler found")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    with pytest.raises(ValueError, match=r"'compile'.*no C\+\+ compiler"):
        choose(compile=True)


def test_the_choice_is_logged_once_with_its_reason(fake_cuda, caplog):
    with caplog.at_level(logging.INFO, logger="train.kernels"):
        plan = choose(head_dims=[8])
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [plan.describe()]
    assert lines[0].startswith("kernels: device cuda, bf16 autocast, attention sdpa (auto: sdpa") and lines[0].endswith(
        "compile off"
    )


def test_the_plan_builds_the_mask_its_kernel_takes():
    from torch.nn.attention.flex_attention import BlockMask, create_mask

    anchors_BN, keep_BN = torch.tensor([[3, 9, 0]]), torch.tensor([[True, True, False]])
    cpu = torch.device("cpu")
    dense = K.KernelPlan(cpu, None, "sdpa", False, "test").mask(anchors_BN, keep_BN, 12, 4)
    assert torch.equal(dense, build_dense_mask(anchors_BN, keep_BN, 12, 4))
    block = K.KernelPlan(cpu, None, "flex", False, "test").mask(anchors_BN, keep_BN, 12, 4)
    assert isinstance(block, BlockMask)
    assert torch.equal(create_mask(block.mask_mod, 1, None, 12, 24, device="cpu"), dense)  # the same rule


def test_a_data_parallel_rank_runs_on_its_own_device_and_only_rank_0_logs(fake_cuda, caplog):
    """Under torchrun each rank's plan is for its own GPU (cuda:LOCAL_RANK from train.distributed),
    with the same choices as the plain run; the line is logged once per run, by rank 0."""
    from types import SimpleNamespace

    from common.config import load_config
    from train.config import TrainConfig
    from train.distributed import Dist
    from train.prepare import choose_run_kernels

    with caplog.at_level(logging.INFO, logger="train.kernels"):
        plain = choose(head_dims=[64])
        rank1 = choose_kernels(
            "auto",
            "auto",
            "auto",
            False,
            [64],
            training=True,
            keys=TRAIN_KEYS,
            rank_device=torch.device("cuda", 1),
            announce=False,
        )
    assert rank1.device == torch.device("cuda", 1) and plain.device == torch.device("cuda")
    assert rank1.to_dict() == plain.to_dict() and rank1.describe() == plain.describe()
    assert [r.getMessage() for r in caplog.records] == [plain.describe()]  # rank 1 said nothing

    caplog.clear()
    cfg, drafter_cfg = (
        load_config(TrainConfig, None, []),
        SimpleNamespace(head_dim=64),
    )  # the choice reads only the head dim
    with caplog.at_level(logging.INFO, logger="train.kernels"):
        plans = [
            choose_run_kernels(
                cfg, drafter_cfg, Dist(rank=r, world_size=2, local_rank=r, device=torch.device("cuda", r))
            )
            for r in range(2)
        ]
    assert [p.device for p in plans] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert [r.getMessage() for r in caplog.records] == [plans[0].describe()]
    assert choose_run_kernels(cfg, drafter_cfg).device == torch.device("cuda")  # no process group: the config's device
