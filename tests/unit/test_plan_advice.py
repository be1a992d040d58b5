"""The advice `h3train check` prints beside its verdict agrees with the plan it is about: no fix the run
already has, no pack budget that would refuse the longest sample, and a pack that refuses it said so."""

from __future__ import annotations

import inspect
from dataclasses import replace

import pytest
from diffusers import MiniMaxH3Transformer3DModel

from h3train.plan import format_plan, plan_memory, verdict
from h3train.plan.printout import fixes, origin_words
from h3train.run.rehearse.formatting import TINY_MODEL_PARAMS, tiny_model_note
from h3train.tasks.released import LONGEST_ROWS


@pytest.fixture(scope="module")
def dims() -> dict:
    sig = inspect.signature(MiniMaxH3Transformer3DModel.__init__)
    return {n: p.default for n, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}


def _plan(dims: dict, **kw):
    """The released model on one 80 GiB device, which no policy fits: a `fits: NO` plan."""
    args = dict(dp_replicate=1, dp_shard=1, sp=1, dtype="bfloat16", activation_checkpointing="none", rows=40_000)
    args.update(kw)
    plan = plan_memory(dims, **args)
    assert not plan.fits
    return replace(plan, longest_fit=12_000)


@pytest.mark.parametrize("policy", ["full", "auto"])
def test_no_recompute_advice_when_every_block_already_recomputes(dims: dict, policy: str) -> None:
    plan = _plan(dims, activation_checkpointing=policy)
    # `auto` that fits nothing chooses full recompute for every block: advising it again is advising nothing.
    assert set(plan.policies) == {"full"}
    assert "activation_checkpointing" not in fixes(plan) and "activation_checkpointing" not in verdict(plan)


def test_recompute_and_offload_advised_only_where_the_run_lacks_them(dims: dict) -> None:
    plan = _plan(dims)
    assert "set model.activation_checkpointing=full" in fixes(plan)
    assert "parallel.cpu_offload" in fixes(plan)
    offloaded = _plan(dims, cpu_offload=True, dp_shard=1)
    assert "parallel.cpu_offload" not in fixes(offloaded)


def test_no_pack_budget_below_the_longest_sample_is_advised(dims: dict) -> None:
    packed = replace(_plan(dims), packed=True)
    # The longest sample fits a pack that fits: that pack is the advice.
    assert "set data.pack=12000 (rows per micro-batch)," in fixes(replace(packed, longest_sample_rows=9_000))
    # Longer than any pack that fits: a budget of 12,000 would refuse it, so it is dropped instead.
    longer = fixes(replace(packed, longest_sample_rows=30_000))
    assert "data.pack=12000 (rows" not in longer
    assert "set data.max_rows=12000 (drops the samples over it: the longest packs to 30,000 rows" in longer
    # Not known: the budget is advised with its condition.
    assert "set data.pack=12000 (rows per micro-batch) if no sample packs to more" in fixes(packed)
    # Unpacked runs bound the rows with data.max_rows, as before.
    assert fixes(_plan(dims)).startswith("set data.max_rows=12000 (drops longer samples)")


def test_a_fitting_pack_smaller_than_the_longest_sample_says_the_run_refuses_it(dims: dict) -> None:
    plan = plan_memory(
        dims, dp_replicate=1, dp_shard=64, sp=8, dtype="bfloat16", activation_checkpointing="full", rows=20_000
    )
    assert plan.fits
    packed = replace(plan, packed=True, longest_sample_rows=LONGEST_ROWS)
    line = verdict(packed)
    assert line.startswith("fits: yes") and f"the longest sample packs to {LONGEST_ROWS:,} rows" in line
    assert "more than data.pack=20000: the run refuses it" in line and "data.pack_oversize=alone" in line
    # A pack that holds it (or an unpacked run) says nothing of the kind.
    assert "refuses" not in verdict(replace(packed, longest_sample_rows=19_000))
    assert "refuses" not in verdict(plan)


def test_the_longest_sample_is_named_once(dims: dict) -> None:
    origin = "data.pack=2000 rows per micro-batch; longest sample: longest sample in the dataset indexes: 'clip_7'"
    assert (
        origin_words(origin) == "data.pack=2000 rows per micro-batch; longest sample in the dataset indexes: 'clip_7'"
    )
    synthetic = "data.pack=2000 rows per micro-batch; longest sample: synthetic geometry"
    assert origin_words(synthetic) == synthetic
    text = format_plan(replace(_plan(dims), rows_origin=origin))
    assert "longest sample: longest sample" not in text and "longest sample in the dataset indexes" in text


def test_a_tiny_models_disagreement_is_put_down_to_fixed_overheads(dims: dict) -> None:
    tiny = {**dims, "num_layers": 1, "num_refiner_layers": 1, "hidden_size": 64, "num_attention_heads": 1,
            "attention_head_dim": 64, "ffn_dim": 128, "text_dim": 16}  # fmt: skip
    plan = plan_memory(
        tiny, dp_replicate=1, dp_shard=1, sp=1, dtype="bfloat16", activation_checkpointing="full", rows=64
    )
    assert plan.params.total < TINY_MODEL_PARAMS
    assert "fixed overheads" in tiny_model_note(plan) and f"{plan.params.total:,} parameters" in tiny_model_note(plan)
    # At a real size the verdict stands alone.
    assert tiny_model_note(_plan(dims)) == ""
