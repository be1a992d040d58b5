"""The memory plan: exact parameter counts, per-rank scaling, activation constants, cluster configs."""

from __future__ import annotations

import inspect
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel

from h3train.config import load_config
from h3train.model.architecture import model_dims
from h3train.plan import (
    GIB,
    block_activation_row_bytes,
    estimate,
    format_plan,
    parameter_counts,
    plan_memory,
)
from h3train.plan.printout import checkpointing_line
from h3train.tasks.released import LONGEST_GEOMETRY, LONGEST_ROWS, SHORT_ROWS

from helpers.paths import ROOT

CLUSTER_CONFIGS = ["h3_fl2va_a100.yaml", "h3_a100_16gpu.yaml", "h3_a100_32gpu.yaml", "h3_a100_64gpu.yaml"]

# A narrow model with the same module structure, for counting and for measuring activations.
SMALL = dict(
    num_attention_heads=4,
    attention_head_dim=64,
    hidden_size=192,
    num_layers=2,
    num_refiner_layers=1,
    ffn_dim=512,
    text_dim=32,
    freq_dim=32,
    time_embed_hidden_dim=64,
    time_embed_dim=96,
    rope_freq_dim=8,
)


def _defaults() -> dict:
    sig = inspect.signature(MiniMaxH3Transformer3DModel.__init__)
    return {n: p.default for n, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}


@pytest.fixture(scope="module")
def full_dims() -> dict:
    return _defaults()


@pytest.fixture(scope="module")
def pretrained_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A stand-in for /models/MiniMax-H3: only the two transformers' config.json, default dims."""
    root = tmp_path_factory.mktemp("MiniMax-H3")
    cfg = {k: list(v) if isinstance(v, tuple) else v for k, v in _defaults().items()}
    for partition in ("transformer", "transformer_ref"):
        (root / partition).mkdir()
        config = {"_class_name": "MiniMaxH3Transformer3DModel", **cfg}
        (root / partition / "config.json").write_text(json.dumps(config))
    return root


def _meta_count(dims: dict) -> int:
    with torch.device("meta"):
        model = MiniMaxH3Transformer3DModel(**dims)
    return sum(p.numel() for p in model.parameters())


def full_dims_block_bytes(dims: dict) -> int:
    """One transformer block's parameters in bfloat16."""
    return 2 * parameter_counts(dims).block


def _plan(dims: dict, **kw):
    args = dict(dp_replicate=1, dp_shard=1, sp=1, dtype="bfloat16", activation_checkpointing="full", rows=40_000)
    args.update(kw)
    return plan_memory(dims, **args)


def test_full_model_parameter_count_is_33_1b_and_matches_a_meta_build(full_dims: dict) -> None:
    counts = parameter_counts(full_dims)
    assert counts.total == _meta_count(full_dims)
    assert round(counts.total / 1e9, 1) == 33.1
    with torch.device("meta"):
        block = MiniMaxH3Transformer3DModel(**{**full_dims, "num_layers": 1}).transformer_blocks[0]
    assert counts.block == sum(p.numel() for p in block.parameters())
    assert counts.block_adaln == block.adaln_proj.linear.weight.numel() + block.adaln_proj.linear.bias.numel()


def test_parameter_count_follows_the_dims(full_dims: dict) -> None:
    dims = {**full_dims, **SMALL, "in_channels": 8, "audio_in_channels": 16, "patch_size": (1, 1, 2)}
    assert parameter_counts(dims).total == _meta_count(dims)


def test_missing_dim_names_the_key() -> None:
    with pytest.raises(ValueError, match="hidden_size"):
        parameter_counts({"num_attention_heads": 4})


@pytest.mark.parametrize("dp_shard,sp", [(2, 1), (1, 4), (2, 8), (4, 4)])
def test_sharded_state_scales_with_one_over_shard_size(full_dims: dict, dp_shard: int, sp: int) -> None:
    one = _plan(full_dims)
    many = _plan(full_dims, dp_shard=dp_shard, sp=sp)
    n = dp_shard * sp
    assert many.params_per_rank == -(-one.params_per_rank // n)
    for field in ("master_weights_bytes", "grads_bytes", "optimizer_bytes"):
        assert getattr(many, field) == pytest.approx(getattr(one, field) / n, rel=1e-9)
    assert many.optimizer_bytes == 2 * many.master_weights_bytes  # exp_avg + exp_avg_sq, float32
    # Across ranks: the block running and the one prefetched, whatever the mesh. On one rank no block reshards
    # after forward: every block not yet through its backward stays gathered.
    two = _plan(full_dims, dp_shard=2)
    assert many.unsharded_params_bytes == two.unsharded_params_bytes == 2 * full_dims_block_bytes(full_dims)
    assert one.unsharded_params_bytes > many.unsharded_params_bytes


@pytest.mark.parametrize("dp_shard,sp", [(2, 1), (1, 8), (2, 8)])
def test_adaln_tables_keep_the_projection_out_of_the_gathered_block_and_its_gradient(
    full_dims: dict, dp_shard: int, sp: int
) -> None:
    """`parallel.adaln_tables`: the projection's weight and bias stay sharded where they live, so neither the
    running block nor the unsharded block gradient holds them (the prefetched block is counted whole, as the
    rehearsal cannot confirm its saving); its shards stay in the sharded state."""
    counts = parameter_counts(full_dims)
    gathered = _plan(full_dims, dp_shard=dp_shard, sp=sp)
    tables = _plan(full_dims, dp_shard=dp_shard, sp=sp, adaln_tables=True)
    assert tables.local_adaln and not gathered.local_adaln
    assert tables.unsharded_params_bytes == 2 * (2 * counts.block - counts.block_adaln)
    assert gathered.unsharded_params_bytes - tables.unsharded_params_bytes == 2 * counts.block_adaln
    # The unsharded gradient in bf16 and FSDP2's float32 reduce-scatter buffer of one, both without the projection.
    assert gathered.unsharded_grads_bytes - tables.unsharded_grads_bytes == (2 + 4) * counts.block_adaln
    assert tables.reduce_buffer_bytes == 4 * (counts.block - counts.block_adaln)
    assert tables.sharded_state_bytes == gathered.sharded_state_bytes
    assert "AdaLN projections stay sharded" in format_plan(tables)
    # Nothing to serve on one rank (no shard group) or offloaded: the projection is gathered as before.
    for kw in ({}, {"dp_shard": 2, "cpu_offload": True}):
        served = _plan(full_dims, adaln_tables=True, **kw)
        assert not served.local_adaln
        assert served == replace(_plan(full_dims, **kw), adaln_tables=True)


def test_reduce_scatter_buffer_is_one_block_gradient_in_float32(full_dims: dict) -> None:
    """Across ranks FSDP2 copies each block's unsharded gradient into a float32 buffer (its reduce dtype) for
    the reduce-scatter and holds it until the next block's post-backward: from the second block the backward
    runs, a block's gradient in the compute dtype has the previous one's buffer beside it, whatever the
    compute dtype. On one rank the measured peaks hold none beside a block."""
    from h3train.config import LoraConfig
    from h3train.lora.adapters import lora_counts

    counts = parameter_counts(full_dims)
    last = f"block {counts.num_layers - 1}"
    # Full recompute keeps one block's input per block, less than the buffer: the peak is where it is held.
    for dtype, b in (("bfloat16", 2), ("float32", 4)):
        plan = _plan(full_dims, dp_shard=8, dtype=dtype)
        assert plan.peak_phase.startswith("block") and plan.peak_phase != last
        assert plan.reduce_buffer_bytes == 4 * counts.block
        assert plan.unsharded_grads_bytes == (b + 4) * counts.block
    assert "float32 reduce-scatter buffer" in format_plan(_plan(full_dims, dp_shard=8))
    # Keeping every activation, the first block of the backward (no buffer before it) is the peak.
    kept = _plan(full_dims, dp_shard=8, activation_checkpointing="none")
    assert kept.peak_phase == last and kept.reduce_buffer_bytes == 0
    assert kept.unsharded_grads_bytes == 2 * counts.block
    assert _plan(full_dims).reduce_buffer_bytes == 0
    # A LoRA reduces its adapters' gradients only.
    lora = lora_counts(full_dims, LoraConfig(rank=32))
    assert _plan(full_dims, sp=8, lora=lora).reduce_buffer_bytes in (0, 4 * lora.block_trainable)


def test_device_kinds_plan_the_memory_torch_reports(full_dims: dict) -> None:
    """A card is planned as torch reports its memory, below its nominal size (an 80 GB card is not 80 GiB)."""
    from h3train.plan.step_time import DEFAULT_DEVICE, DEVICE_KINDS

    nominal = {"a100": 80, "h100": 80, "h200": 141}
    for key, kind in DEVICE_KINDS.items():
        assert kind.memory_gib < nominal[key], key
    plan = _plan(full_dims)
    assert plan.device_bytes == int(DEVICE_KINDS[DEFAULT_DEVICE].memory_gib * GIB)


def test_replication_does_not_divide_state(full_dims: dict) -> None:
    hsdp = _plan(full_dims, dp_replicate=4, dp_shard=2, sp=8)
    fsdp = _plan(full_dims, dp_replicate=1, dp_shard=2, sp=8)
    assert hsdp.world_size == 64 and hsdp.shard_size == 16
    assert hsdp.total_bytes == fsdp.total_bytes


def test_activations_split_over_sp(full_dims: dict) -> None:
    # Both over 8 ranks, so that both peaks fall where FSDP2's reduce-scatter buffer is held.
    sp1 = _plan(full_dims, dp_shard=8, sp=1)
    sp8 = _plan(full_dims, sp=8)
    assert sp1.peak_phase == sp8.peak_phase
    assert sp8.local_rows == 5_000
    # sp > 1 adds the all-to-all copy of the attention output to each block's rows.
    extra = 56 * 128 * 2 * 5_000
    assert sp8.activation_bytes - extra == pytest.approx(sp1.activation_bytes / 8, rel=1e-6)
    # The sequence is padded up to a multiple of sp.
    assert _plan(full_dims, sp=8, rows=40_001).local_rows == 5_001


def test_checkpointing_reduces_activations(full_dims: dict) -> None:
    on = _plan(full_dims, activation_checkpointing="full")
    off = _plan(full_dims, activation_checkpointing="none")
    assert on.activation_bytes < off.activation_bytes / 10
    assert on.total_bytes < off.total_bytes


def test_float32_compute_costs_more_than_bfloat16(full_dims: dict) -> None:
    bf16 = _plan(full_dims, dp_shard=16)
    fp32 = _plan(full_dims, dp_shard=16, dtype="float32")
    assert fp32.sharded_state_bytes == bf16.sharded_state_bytes  # master weights are fp32 either way
    assert fp32.unsharded_params_bytes == 2 * bf16.unsharded_params_bytes
    assert fp32.activation_bytes > bf16.activation_bytes


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_block_activation_constant_matches_what_autograd_saves(full_dims: dict, dtype: str) -> None:
    """Sum the distinct storages autograd keeps for one block on CPU (composite RMSNorm, flash SDPA)."""
    dims = {**full_dims, **SMALL, "num_layers": 1}
    torch_dtype = getattr(torch, dtype)
    torch.manual_seed(0)
    model = MiniMaxH3Transformer3DModel(**dims)
    block = model.transformer_blocks[0].to(torch_dtype)
    rows = 256
    x = torch.randn(1, rows, dims["hidden_size"], dtype=torch_dtype, requires_grad=True)
    temb = torch.randn(2, dims["time_embed_dim"], dtype=torch_dtype)
    index = torch.randint(0, 6, (rows,))
    rotary = model.rope(torch.rand(rows, 3) * 8)
    excluded = {p.untyped_storage().data_ptr() for p in block.parameters()}
    excluded |= {index.untyped_storage().data_ptr(), temb.untyped_storage().data_ptr()}
    excluded |= {t.untyped_storage().data_ptr() for t in rotary}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in excluded:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, temb, index, rotary)
    # The one save that does not scale with rows: silu(temb), the AdaLN projection's input.
    per_timestep = temb.numel() * torch_dtype.itemsize
    assert sum(saved.values()) - per_timestep == rows * block_activation_row_bytes(dims, dtype)


def test_released_row_counts_match_the_diffusers_layout() -> None:
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
        MINIMAX_H3_AUDIO_CHANNELS,
        MINIMAX_H3_AUDIO_TAG,
        MINIMAX_H3_VIDEO_TAG,
        align_num_frames,
        audio_latent_num_frames,
        video_latent_num_frames,
    )

    for seconds, rows in ((5, SHORT_ROWS), (15, LONGEST_ROWS)):
        frames = align_num_frames(seconds * 24, 17, 5)
        positions = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
            torch.ones(2048, dtype=torch.long),
            video_latent_num_frames(frames, 17, 5),
            768 // 16,
            1344 // 16,
            audio_latent_num_frames(frames),
            (1, 2, 2),
            MINIMAX_H3_AUDIO_CHANNELS,
            MINIMAX_H3_AUDIO_TAG,
            MINIMAX_H3_VIDEO_TAG,
            ("first", "last"),
        )[0]
        assert positions.shape[0] == rows


def test_naive_single_gpu_full_fine_tune_does_not_fit(full_dims: dict) -> None:
    plan = _plan(full_dims, rows=SHORT_ROWS)
    assert not plan.fits
    assert plan.sharded_state_bytes / GIB > 490  # 16 bytes x 33.1 B parameters
    assert "fits: NO" in format_plan(plan)


def _resolved_plan(cfg, mesh, dims: dict, rows: int):
    """The plan of the setting `parallel.adaln_tables` takes on the default card (`plan.tables`, as `check`)."""
    from h3train.plan.step_time import DEFAULT_DEVICE, rates_of_kind
    from h3train.plan.tables import choose_tables

    def plan_of(c, d):
        return estimate(dims, d, c, rows=rows, fused_norm=True)

    choice = choose_tables(cfg, mesh, dims, rates_of_kind(DEFAULT_DEVICE), ranks_per_node=8, plan_of=plan_of)
    return choice.plans[choice.served]


def _load_cluster_config(name: str, folder: Path):
    return load_config(ROOT / "configs" / name, [f"model.pretrained={folder}"])


@pytest.mark.one_lane
@pytest.mark.parametrize("name", [*CLUSTER_CONFIGS, "h3_ref2va_cfg_a100.yaml"])
def test_cluster_config_fits_per_the_plan(name: str, pretrained_folder: Path) -> None:
    """Each config states `# plan: world W, rows R, total T GiB`; the plan must reproduce it and fit."""
    from h3train.parallel.dims import ParallelDims

    text = (ROOT / "configs" / name).read_text()
    m = re.search(r"^# plan: world (\d+), rows (\d+), total ([\d.]+) GiB$", text, re.MULTILINE)
    assert m, f"{name} lacks its '# plan:' line"
    world, rows, total = int(m[1]), int(m[2]), float(m[3])
    cfg = _load_cluster_config(name, pretrained_folder)
    assert cfg.model.dtype == "bfloat16" and cfg.model.activation_checkpointing == "auto"
    assert cfg.data.source == "cached" and cfg.parallel.sp in (4, 8)
    assert cfg.checkpoint.every > 0 and cfg.checkpoint.resume == "auto"
    mesh = ParallelDims.from_config(cfg.parallel, world)
    # The header states the plan of CUDA's fused RMSNorm (torch 2.9 and later), whatever torch runs this test.
    plan = _resolved_plan(cfg, mesh, model_dims(cfg), rows)
    assert plan.params.total == parameter_counts(_defaults()).total
    assert plan.fits, format_plan(plan)
    assert round(plan.total_bytes / GIB, 2) == total
    takes = re.search(r"^# takes: (.*)$", text, re.MULTILINE)
    assert takes and f"recompute {checkpointing_line(plan)} on torch >= 2.9" in takes[1], name
    assert f"{rows:,}-row samples" in takes[1] and f"at {world} ranks" in takes[1]
    assert f"total {total:.2f} GiB" in text
    # A full fine-tune's checkpoint: float32 weights and AdamW's two moments, plus the EMA if on.
    copies = 3 + (cfg.train.ema.decay > 0)
    assert plan.checkpoint_bytes == copies * 4 * plan.params.total
    assert f"checkpoint    {plan.checkpoint_bytes / GIB:.2f} GiB on disk each" in format_plan(plan)


def test_cluster_configs_keep_the_global_batch(pretrained_folder: Path) -> None:
    from h3train.parallel.dims import ParallelDims

    for name, world in zip(CLUSTER_CONFIGS, (8, 16, 32, 64)):
        cfg = _load_cluster_config(name, pretrained_folder)
        dims = ParallelDims.from_config(cfg.parallel, world)
        assert dims.dp * cfg.train.grad_accum == 16, name


def test_cluster_configs_plan_without_the_model_folder_but_train_needs_it(tmp_path: Path) -> None:
    """Away from the folder the plan is the released architecture's; training refuses to start."""
    from h3train.errors import ConfigError
    from h3train.model.architecture import planned_model_dims
    from h3train.run.preflight import preflight

    cfg = _load_cluster_config("h3_a100_16gpu.yaml", tmp_path)
    dims, note = planned_model_dims(cfg)
    assert parameter_counts(dims).total == parameter_counts(_defaults()).total
    assert note is not None and str(tmp_path / "transformer" / "config.json") in note
    assert any("released" in n for n in preflight(cfg, planning=True).notes)
    with pytest.raises(ConfigError, match="model.pretrained"):
        preflight(cfg)


def test_estimate_uses_the_synthetic_geometry() -> None:
    from h3train.parallel.dims import ParallelDims

    cfg = load_config(ROOT / "configs" / "tiny_fl2va.yaml", ["parallel.sp=2"])
    plan = estimate(model_dims(cfg), ParallelDims.from_config(cfg.parallel, 2), cfg)
    # 13 text rows, 2 keyframes x 6 rows, 2 x 7 audio rows, 2 latent frames x 6 rows.
    assert plan.rows == 13 + 12 + 14 + 12 and plan.local_rows == 26
    assert plan.fits


def test_estimate_uses_the_longest_cached_sample(tmp_path: Path) -> None:
    from h3train.data.dataset import CachedDataset
    from h3train.data.synthetic_dataset import write_synthetic_dataset
    from h3train.parallel.dims import ParallelDims

    write_synthetic_dataset(tmp_path / "data", task="fl2va", num_samples=6, seed=0, text_dim=16)
    cfg = load_config(ROOT / "configs" / "tiny_fl2va.yaml", ["data.source=cached", f"data.path={tmp_path / 'data'}"])
    plan = estimate(model_dims(cfg), ParallelDims.from_config(cfg.parallel, 1), cfg)
    assert plan.rows == max(CachedDataset(tmp_path / "data", "fl2va").lengths)
    # Away from the data (planning on a login node) the longest released clip stands in.
    cfg.data.path = str(tmp_path / "elsewhere")
    assert estimate(model_dims(cfg), ParallelDims.from_config(cfg.parallel, 1), cfg).rows == LONGEST_ROWS


def test_a_t2va_plan_away_from_the_data_uses_the_released_clip_without_keyframes(full_dims: dict) -> None:
    from h3train.parallel.dims import ParallelDims
    from h3train.tasks.layout import Geometry
    from h3train.tasks.sample import build_layout

    plans = {}
    for task in ("fl2va", "t2va"):
        cfg = load_config(
            ROOT / "configs" / "h3_fl2va_a100.yaml",
            [f"task.name={task}", "data.path=/nowhere", "data.max_rows=0", "model.activation_checkpointing=full"],
        )
        plans[task] = estimate(full_dims, ParallelDims.from_config(cfg.parallel, 64), cfg)
        assert plans[task].rows_origin.startswith(f"longest released {task} clip")
    geometry = Geometry(*LONGEST_GEOMETRY)
    tags = torch.ones(plans["t2va"].text_rows, dtype=torch.long)
    # The same clip: the t2va layout (no keyframe rows) and the fl2va one (first and last).
    assert plans["t2va"].rows == build_layout("t2va", tags, geometry).seq_len
    assert plans["fl2va"].rows == build_layout("fl2va", tags, geometry, ("first", "last")).seq_len == LONGEST_ROWS
    assert plans["fl2va"].rows - plans["t2va"].rows == 2 * geometry.video_rows() // geometry.num_latent_frames
    assert plans["t2va"].activation_bytes < plans["fl2va"].activation_bytes


def test_unreadable_dataset_index_is_a_config_error(tmp_path: Path) -> None:
    from h3train.errors import ConfigError
    from h3train.parallel.dims import ParallelDims

    (tmp_path / "data").mkdir()
    cfg = load_config(ROOT / "configs" / "tiny_fl2va.yaml", ["data.source=cached", f"data.path={tmp_path / 'data'}"])
    with pytest.raises(ConfigError, match="data.path.*index.jsonl"):
        estimate(model_dims(cfg), ParallelDims.from_config(cfg.parallel, 1), cfg)


def test_format_plan_lists_every_term(full_dims: dict) -> None:
    text = format_plan(_plan(full_dims, dp_replicate=2, dp_shard=2, sp=8, rows=LONGEST_ROWS))
    for needle in (
        "33,122,992,896",
        "dp_replicate=2 dp_shard=2 sp=8",
        "master weights fp32",
        "gradients fp32",
        "AdamW",
        "unsharded block",
        "activations",
        "reserve",
        "total",
        "fits: yes",
    ):
        assert needle in text


LORA_CONFIGS = ["h3_fl2va_lora_a100.yaml", "h3_ref2va_lora_a100.yaml"]


@pytest.mark.one_lane
@pytest.mark.parametrize("name", LORA_CONFIGS)
def test_lora_config_fits_per_the_plan_and_checks_without_the_model_folder(name: str, tmp_path: Path, capsys) -> None:
    """The LoRA configs' `# plan:` line is reproduced, and `h3train check` plans them away from the model."""
    from h3train.cli import main
    from h3train.parallel.dims import ParallelDims

    text = (ROOT / "configs" / name).read_text()
    m = re.search(r"^# plan: world (\d+), rows (\d+), total ([\d.]+) GiB$", text, re.MULTILINE)
    assert m, f"{name} lacks its '# plan:' line"
    world, rows, total = int(m[1]), int(m[2]), float(m[3])
    cfg = _load_cluster_config(name, tmp_path)
    assert cfg.lora.rank > 0 and world == 8
    # The header states the plan of CUDA's fused RMSNorm (torch 2.9 and later), whatever torch runs this test.
    plan = _resolved_plan(cfg, ParallelDims.from_config(cfg.parallel, world), _defaults(), rows)
    assert plan.lora is not None and plan.fits, format_plan(plan)
    assert round(plan.total_bytes / GIB, 2) == total
    assert main(["check", str(ROOT / "configs" / name), f"model.pretrained={tmp_path}", "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "LoRA          rank 32 on 300 Linear layers" in out
    assert "8 x A100-80GB (sp=8)" in out and "1 x 80 GB GPU (sp=1)" in out


def test_lora_plan_counts_what_a_peft_build_holds() -> None:
    """Adapter count and frozen-base bytes equal those of the LoRA transform applied to a real model."""
    from h3train.lora.adapters import add_adapters, lora_counts

    overrides = [f"model.config.{k}={v}" for k, v in SMALL.items()]
    cfg = load_config(ROOT / "configs" / "tiny_lora.yaml", [*overrides, "lora.rank=8", "lora.train_modules=[norm_out]"])
    dims = model_dims(cfg)
    counts = lora_counts(dims, cfg.lora)
    model = MiniMaxH3Transformer3DModel(**cfg.model.config)
    add_adapters(model, cfg)
    named = dict(model.named_parameters())
    adapters = sum(p.numel() for n, p in named.items() if ".lora_" in n)
    train_modules = sum(p.numel() for n, p in named.items() if p.requires_grad and ".lora_" not in n)
    frozen_bytes = sum(p.numel() * p.element_size() for p in named.values() if not p.requires_grad)
    assert (counts.adapters, counts.train_modules) == (adapters, train_modules) and train_modules > 0
    block = [n for n in named if n.startswith("transformer_blocks.0.") and ".lora_" in n]
    assert counts.block_adapters == sum(named[n].numel() for n in block)
    plan = _plan(dims, lora=counts, dtype="float32")
    assert plan.master_weights_bytes == frozen_bytes + 4 * (adapters + train_modules)
    assert (plan.grads_bytes, plan.optimizer_bytes) == (4 * counts.trainable, 8 * counts.trainable)


def test_lora_longest_fit_is_the_edge_of_the_plan(full_dims: dict) -> None:
    from h3train.config import LoraConfig
    from h3train.lora.adapters import lora_counts
    from h3train.plan import longest_fit_rows

    counts = lora_counts(full_dims, LoraConfig(rank=32))
    args = dict(dp_replicate=1, dtype="bfloat16", activation_checkpointing="full", lora=counts)
    # On one rank no block reshards after forward (model/fsdp.py): a second, gathered bf16 copy of the
    # 61.7 GiB base leaves an 80 GB GPU no room for a row.
    assert longest_fit_rows(full_dims, dp_shard=1, sp=1, **args) == 0
    for dp_shard, sp in ((1, 8), (2, 1)):
        rows = longest_fit_rows(full_dims, dp_shard=dp_shard, sp=sp, **args)
        assert rows > 0 and rows % sp == 0
        assert plan_memory(full_dims, dp_shard=dp_shard, sp=sp, rows=rows, **args).fits
        assert not plan_memory(full_dims, dp_shard=dp_shard, sp=sp, rows=rows + sp, **args).fits
    lora = plan_memory(full_dims, dp_shard=1, sp=8, rows=LONGEST_ROWS, **args)
    full = _plan(full_dims, sp=8, rows=LONGEST_ROWS)
    # The base alone is 2 B / param, a full fine-tune's state 16 B / param.
    assert lora.sharded_state_bytes < full.sharded_state_bytes / 7
    # One 80 GB GPU holds the bf16 base (61.7 GiB) but no 768x1344 clip beside it.
    assert lora.fits and not plan_memory(full_dims, dp_shard=1, sp=1, rows=SHORT_ROWS, **args).fits


@pytest.mark.parametrize("preset", ["video_only", "audio_only"])
def test_output_projection_adapters_keep_no_activations_in_the_stack(full_dims: dict, preset: str) -> None:
    """Adapters on the output projections alone: no gradient reaches the blocks or the refiner, so the
    plan is a small fraction of rank 32 on every block's, with or without checkpointing."""
    from h3train.config.schema import LoraConfig
    from h3train.lora.adapters import lora_counts

    heads = lora_counts(full_dims, LoraConfig(rank=32, target_modules=[preset]))
    blocks = lora_counts(full_dims, LoraConfig(rank=32))
    assert heads.heads_only and not blocks.heads_only
    args = dict(dp_replicate=1, dp_shard=8, sp=8, dtype="bfloat16", rows=LONGEST_ROWS, text_rows=512)
    for ckpt in ("none", "full"):
        few = plan_memory(full_dims, activation_checkpointing=ckpt, lora=heads, **args)
        many = plan_memory(full_dims, activation_checkpointing=ckpt, lora=blocks, **args)
        assert few.refiner_activation_bytes == 0
        assert "only the output projections train" in format_plan(few)
        assert few.activation_bytes < many.activation_bytes / 10, (ckpt, few.activation_bytes, many.activation_bytes)


@pytest.mark.parametrize("preset", ["video_only", "audio_only"])
def test_output_projection_adapter_activations_match_what_the_forward_keeps(preset: str) -> None:
    """The heads-only plan against `saved_activation_bytes` of the tiny model's forward and loss."""
    from helpers.activations import TOLERANCE, activations

    planned, held = activations(preset, "h256", "float32", "none", 1)
    # An upper bound (every row outside the text counted as predicted by each trained projection), and close.
    assert held <= planned <= held * (1 + TOLERANCE), (planned, held)
