"""The forecast's engine overheads (planning/forecast.py Overheads) and their fit to timed steps
(planning/overhead_fit.py): what an engine spends besides FLOPs and collectives, per tensor,
byte, micro-batch and step, measured by `dplaunch calibrate` rather than fitted on a benchmark."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dplaunch.planning.forecast import (
    Overheads,
    PhaseOverhead,
    forecast_step,
    overheads_for,
    visible_overhead,
)
from dplaunch.planning.overhead_fit import TimedStep, fit_overheads, non_negative_least_squares
from dplaunch.planning.profiles import Profile
from dplaunch.planning.rules import ParallelDims
from dplaunch.planning.workload import Workload
from tests.helpers import llama_facts, synthetic_profile

# what a made-up machine's engines spend, family by family (seconds per unit): every family's
# forward and backward are DDP's dispatch and what its own engine adds
KNOWN = {
    "ddp": Overheads(forward_tensor_s=1e-4, backward_tensor_s=2e-4, step_s=5e-3, step_tensor_s=5e-5),
    "zero2": Overheads(
        forward_s=1e-3, forward_tensor_s=1e-4, backward_tensor_s=3e-4, backward_byte_s=3e-9,
        step_s=8e-3, step_tensor_s=1e-4,
    ),
    "zero3": Overheads(forward_tensor_s=5e-3, backward_tensor_s=8e-3, step_s=5e-3),
    "fsdp": Overheads(
        forward_tensor_s=1e-3, forward_byte_s=2e-9, backward_tensor_s=1e-3, backward_byte_s=1e-9,
        step_s=3e-3,
    ),
    "ulysses": Overheads(exchange_s=2e-3, exchange_byte_s=1e-9),
}  # fmt: skip
LAYOUTS = {
    "ddp": ParallelDims(2, 2),
    "zero2": ParallelDims(2, 2, zero_stage=2),
    "zero3": ParallelDims(2, 2, zero_stage=3),
    "fsdp": ParallelDims(2, 2, fsdp="full"),
    "ulysses": ParallelDims(2, 2, sp=2),
}
# calibrate's shapes: two hidden sizes at 2 layers, and more layers at the small one
SHAPES = ((64, 2), (256, 2), (64, 6))


def timed_steps(truth: Profile, families=LAYOUTS) -> list[TimedStep]:
    """The steps a machine whose overheads are TRUTH's would time: each family at every shape,
    one and two micro-batches a step, DeepSpeed's backward and step timed as one."""
    steps = []
    for family in families:
        dims = LAYOUTS[family]
        deepspeed = family.startswith("zero")
        for hidden, layers in SHAPES:
            facts = llama_facts(hidden, layers)
            for micro_batches in (1, 2):
                work = Workload(2, 64, "no", global_batch_size=2 * micro_batches * dims.dp)
                phases = {
                    phase: sum(parts.values())
                    for phase, parts in forecast_step(facts, dims, work, truth).phases.items()
                }
                if deepspeed:
                    phases = {"forward": phases["forward"], "backward": phases["backward"] + phases["step"], "step": 0.0}  # fmt: skip
                joined = ("backward", "step") if deepspeed else ()
                steps.append(TimedStep(facts, dims, work, phases, joined))
    return steps


def test_the_fit_recovers_each_familys_overheads_from_synthetic_timings():
    profile = synthetic_profile()
    truth = dataclasses.replace(
        profile, overheads={family: terms.to_dict() for family, terms in KNOWN.items()}
    )
    fit = fit_overheads(timed_steps(truth), profile)
    assert set(fit.overheads) == set(KNOWN)
    for family, known in KNOWN.items():
        for name, value in dataclasses.asdict(fit.overheads[family]).items():
            assert value == pytest.approx(getattr(known, name), rel=1e-6, abs=1e-12), (family, name)
        assert fit.residual_s[family] < 1e-9
    # a per-byte copy is told apart from a per-tensor hook, and ZeRO's backward from its step
    # though DeepSpeed times them as one phase
    assert fit.overheads["zero2"].backward_byte_s == pytest.approx(3e-9, rel=1e-6)
    assert fit.overheads["zero2"].step_s == pytest.approx(8e-3, rel=1e-6)
    # what the fit writes into a profile, and reads back
    fitted = fit.to_profile(profile)
    again = Profile.from_dict(json.loads(json.dumps(fitted.to_dict())))
    assert again.overheads == fitted.overheads
    assert overheads_for(again, "zero2") == (fit.overheads["zero2"], True)
    assert "engine overheads fitted to calibrate's steps: ddp (6 steps" in again.notes[-1]


def test_a_rate_error_both_families_share_stays_ddps_and_ddp_copies_nothing():
    # the model at calibrate's shapes runs 20 % slower than the dense rate says: a cost per FLOP
    # (∝ bytes at a fixed token count) that every family pays alike
    profile = synthetic_profile()
    slower = dataclasses.replace(
        profile, dense=tuple(dataclasses.replace(p, flops_per_s=p.flops_per_s / 1.2) for p in profile.dense)
    )  # fmt: skip
    truth = dataclasses.replace(slower, overheads={f: KNOWN[f].to_dict() for f in ("ddp", "zero2")})
    fit = fit_overheads(timed_steps(truth, ("ddp", "zero2")), profile)
    # no per-byte copy invented for DDP, nor for ZeRO-2 beyond its own
    assert fit.overheads["ddp"].forward_byte_s == fit.overheads["ddp"].backward_byte_s == 0.0
    assert fit.overheads["zero2"].backward_byte_s == pytest.approx(3e-9, rel=0.05)


def test_the_fit_keeps_every_term_non_negative_in_noise():
    # a noisy fixed cost the counts cannot explain, and a negative one: never a negative term
    x = non_negative_least_squares([[1.0, 10.0], [1.0, 20.0], [1.0, 30.0]], [0.5, 0.4, 0.3])
    assert all(value >= 0 for value in x)
    assert x[0] == pytest.approx(0.4, rel=1e-6) and x[1] == 0.0


def test_a_profile_without_overheads_still_plans_on_defaults_and_says_so():
    old = synthetic_profile().to_dict()
    del old["overheads"]  # a profile of an older dplaunch
    profile = Profile.from_dict(old)
    assert profile.overheads == {}
    terms, measured = overheads_for(profile, "zero2")
    assert not measured and terms.backward_byte_s > 0  # ZeRO-1/2's gradient copies by default
    facts = llama_facts(64, 2)
    work = Workload(2, 64, "no", global_batch_size=8)
    with_terms = forecast_step(facts, ParallelDims(2, 2, zero_stage=2), work, profile)
    bare = forecast_step(facts, ParallelDims(2, 2, zero_stage=2), work, profile, overheads=False)
    assert with_terms.terms["overhead"] > 0 == bare.terms["overhead"]
    assert with_terms.step_time_s == pytest.approx(bare.step_time_s + with_terms.terms["overhead"])
    # each phase carries its share, as the end-of-run comparison reads them
    assert sum(parts["overhead"] for parts in with_terms.phases.values()) == pytest.approx(
        with_terms.terms["overhead"]
    )


def test_a_small_model_pays_a_fixed_cost_that_its_flops_do_not_show():
    # the tiny Llama under ZeRO-2: most of its step is the engine's own work, not its FLOPs
    profile = dataclasses.replace(
        synthetic_profile(), overheads={f: KNOWN[f].to_dict() for f in ("ddp", "zero2")}
    )
    work = Workload(2, 64, "no", global_batch_size=8)
    tiny = forecast_step(llama_facts(64, 2), ParallelDims(2, 2, zero_stage=2), work, profile)
    assert tiny.terms["overhead"] > tiny.terms["compute"]
    # a larger model's step is its FLOPs', the fixed cost a small share of it (under DDP, which
    # copies no gradient: ZeRO-2's copies grow with the bytes)
    big = forecast_step(llama_facts(1024, 2), ParallelDims(2, 2), work, profile)
    assert big.terms["overhead"] < 0.1 * big.terms["compute"]
    # LoRA's adapters are tensors too: more dispatch than the same model's full training has
    from dplaunch.planning.workload import LoraSpec

    ddp = ParallelDims(2, 2)
    lora = forecast_step(llama_facts(64, 2), ddp, dataclasses.replace(work, lora=LoraSpec(r=8)), profile)  # fmt: skip
    full = forecast_step(llama_facts(64, 2), ddp, work, profile)
    assert lora.phases["forward"]["overhead"] > full.phases["forward"]["overhead"]


def test_on_a_gpu_the_hosts_work_hides_behind_a_longer_device_phase():
    work = PhaseOverhead(host=0.010, device=0.002)
    # the device computes 50 ms: the host's 10 ms of launches run ahead of it
    assert visible_overhead("forward", work, 0.050, gpu=True) == pytest.approx(0.002)
    # a small model's 1 ms (3 ms with the copies) waits for the host: the phase takes its 10 ms
    assert visible_overhead("forward", work, 0.001, gpu=True) == pytest.approx(0.009)
    # the step waits for the device (the loop's verdict), and CPU ranks do everything in turn
    assert visible_overhead("step", work, 0.050, gpu=True) == pytest.approx(0.012)
    assert visible_overhead("forward", work, 0.050, gpu=False) == pytest.approx(0.012)
