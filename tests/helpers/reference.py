"""The unsharded recomputation of a run's step with plain diffusers (and peft), its independent reference.

The reference is single-process and unsharded: `MiniMaxH3Transformer3DModel.forward` on the same
weights and the same inputs, the loss built from the dumped targets, masks and weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from diffusers import MiniMaxH3Transformer3DModel
from safetensors.torch import load_file

from h3train.config import load_config
from h3train.data.source import build_sampler, build_source, load_shared_negative
from h3train.lora.names import export_name
from h3train.objective import compute_loss, micro_batch_inputs

from helpers.launch import dump_dir, read_metrics, tiny_args, train


def reference_step(config: Path, overrides: list[str], dump_dir: Path, dp: int, step: int = 1):
    """Unsharded loss, per-parameter gradients and grad norm of optimizer step `step`.

    Rank 0's inputs are read from the dump; the other DP ranks' inputs are rebuilt from the same
    deterministic sampler and RNG (and rank 0's rebuild is checked against the dump).
    """
    cfg = load_config(config, overrides)
    meta = json.loads((dump_dir / "meta.json").read_text())
    model = MiniMaxH3Transformer3DModel(**meta["model_config"])
    model.load_state_dict(load_file(dump_dir / "weights.safetensors"), strict=True)
    model.float()
    return reference_backward(cfg, meta, model, dump_dir, dp, step)


def reference_model_from_dump(dump_dir: Path) -> MiniMaxH3Transformer3DModel:
    """The dumped step's model rebuilt with diffusers and peft alone, float32, trained parameters unfrozen.

    Full fine-tuning: every parameter trains. LoRA: the base is loaded under its diffusers names, the
    adapter added from the dumped peft config, its factors set with `set_peft_model_state_dict`, and
    the parameters with a dumped gradient (adapters, `lora.train_modules`) are the trained ones.
    """
    from peft import LoraConfig, set_peft_model_state_dict

    meta = json.loads((dump_dir / "meta.json").read_text())
    weights = load_file(dump_dir / "weights.safetensors")
    trained = set(load_file(dump_dir / "grads.safetensors"))
    model = MiniMaxH3Transformer3DModel(**meta["model_config"])
    if meta.get("lora") is None:
        model.load_state_dict(weights, strict=True)
        return model.float()
    is_factor = [k for k in weights if ".lora_A." in k or ".lora_B." in k]
    model.load_state_dict({k: v for k, v in weights.items() if k not in is_factor}, strict=True)
    lora = {k: v for k, v in meta["lora"].items() if k not in ("peft_type", "peft_version", "auto_mapping")}
    model.add_adapter(LoraConfig(**lora))
    result = set_peft_model_state_dict(model, {k: weights[k] for k in is_factor})
    assert not result.unexpected_keys, result.unexpected_keys
    model.float()
    for name, param in model.named_parameters():
        param.requires_grad_(lora_file_name(name) in trained)
    assert {lora_file_name(n) for n, p in model.named_parameters() if p.requires_grad} == trained
    return model


def peft_model_from_dump(dump: Path) -> MiniMaxH3Transformer3DModel:
    """The dumped step's model with diffusers and peft alone, float32, the dumped-gradient parameters trained.

    `reference_model_from_dump` for any peft kind: the recorded config's class is read from
    its `peft_type`, and the adapter's tensors are the dumped weights the plain model does not have.
    """
    from peft import LoHaConfig, LoKrConfig, LoraConfig, set_peft_model_state_dict

    meta = json.loads((dump / "meta.json").read_text())
    weights = load_file(dump / "weights.safetensors")
    trained = set(load_file(dump / "grads.safetensors"))
    record = meta["lora"]
    cls = {"LORA": LoraConfig, "LOKR": LoKrConfig, "LOHA": LoHaConfig}[record["peft_type"]]
    names = {f.name for f in fields(cls)} - {"peft_type", "peft_version", "auto_mapping"}
    model = MiniMaxH3Transformer3DModel(**meta["model_config"])
    base = set(model.state_dict())
    model.load_state_dict({k: v for k, v in weights.items() if k in base}, strict=True)
    model.add_adapter(cls(**{k: v for k, v in record.items() if k in names}))
    result = set_peft_model_state_dict(model, {k: v for k, v in weights.items() if k not in base})
    assert not result.unexpected_keys, result.unexpected_keys
    model.float()
    for name, param in model.named_parameters():
        param.requires_grad_(export_name(name) in trained)
    assert {export_name(n) for n, p in model.named_parameters() if p.requires_grad} == trained
    loaded = {export_name(n): p for n, p in model.named_parameters()}
    assert all(torch.equal(loaded[k], v.float()) for k, v in weights.items() if k not in base), "a value not loaded"
    return model


def lora_file_name(name: str) -> str:
    """A live peft parameter path -> the dump's name for it (diffusers name / peft state-dict name)."""
    return (
        name.replace(".base_layer.", ".")
        .replace(".lora_A.default.", ".lora_A.")
        .replace(".lora_B.default.", ".lora_B.")
    )


def reference_step_from_dump(config: Path, overrides: list[str], dump_dir: Path, dp: int, step: int):
    """`reference_step` for any dump, full or LoRA: (loss, gradients of the trained parameters, norm)."""
    cfg = load_config(config, overrides)
    meta = json.loads((dump_dir / "meta.json").read_text())
    return reference_backward(cfg, meta, reference_model_from_dump(dump_dir), dump_dir, dp, step)


def reference_backward(cfg, meta: dict, model, dump_dir: Path, dp: int, step: int):
    """The unsharded loss, gradients of `model`'s trained parameters and their norm of optimizer step `step`."""
    dumped = load_file(dump_dir / "inputs.safetensors")

    source = build_source(cfg, meta["model_config"]["text_dim"])
    shared = load_shared_negative(cfg)
    accum = cfg.train.grad_accum
    total = torch.zeros((), dtype=torch.float64)
    for rank in range(dp):
        sampler = build_sampler(source, cfg, rank, dp)
        sampler.position = (step - 1) * accum * dp
        for micro in range(accum):
            sample = source[sampler.next_index()]
            ti = micro_batch_inputs(cfg, sample, step, micro * dp + rank, shared)
            if rank == 0:
                branches = {"": ti.model_inputs, "uncond.": ti.uncond_inputs or {}}
                for prefix, inputs in branches.items():
                    for name, value in inputs.items():
                        key = f"m{micro}.{prefix}{name}"
                        assert torch.equal(dumped[key], value), f"dumped {key} differs"
            loss = compute_loss(lambda **kw: model(**kw, return_dict=False), ti).loss
            (loss / (accum * dp)).backward()
            total += loss.detach().double()
    grads = {lora_file_name(name): p.grad.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    norm = torch.sqrt(sum(g.double().square().sum() for g in grads.values()))
    return float(total / (accum * dp)), grads, float(norm)


@dataclass
class Parity:
    """One dumped step of a launched run against the unsharded reference."""

    loss: float
    ref_loss: float
    grad_norm: float
    ref_norm: float
    grads: dict[str, torch.Tensor]
    ref_grads: dict[str, torch.Tensor]
    output: str = ""  # what the run printed (forked ranks only)

    def worst(self) -> tuple[float, str]:
        """The largest per-parameter relative L2 gradient error, and its parameter."""
        return max((relative_l2(self.grads[n], g), n) for n, g in self.ref_grads.items() if g.abs().sum() > 0)


def parity_overrides(steps: int, data: Path, extra: list[str]) -> list[str]:
    """The overrides of a parity run: `steps` steps, step 1 dumped, its dataset (if it writes one) in `data`."""
    return [f"train.steps={steps}", "debug.dump_step=1", f"data.path={data}", *extra]


def parity_of(config: Path, overrides: list[str], run_dir: Path, dp: int, output: str = "") -> Parity:
    """Step 1 of a finished parity run (`parity_overrides`) against its unsharded recomputation (its loss,
    gradients and norm do not depend on the steps after it)."""
    dump = dump_dir(run_dir, 1)
    ref_loss, ref_grads, ref_norm = reference_step(config, overrides, dump, dp=dp)
    metrics = read_metrics(run_dir)[0]
    return Parity(
        metrics["loss"],
        ref_loss,
        metrics["grad_norm"],
        ref_norm,
        load_file(dump / "grads.safetensors"),
        ref_grads,
        output,
    )


def parity_step(
    config: Path,
    extra: list[str],
    run_dir: Path,
    nproc: int,
    dp: int,
    steps: int = 1,
    env: dict[str, str] | None = None,
) -> Parity:
    """Train `steps` steps of `config` on `nproc` ranks (in `env`) with a debug dump of step 1, then
    recompute step 1 unsharded (`parity_of`)."""
    overrides = parity_overrides(steps, run_dir / "data", extra)
    output = train(tiny_args(run_dir, *overrides, config=config), nproc=nproc, env=env)
    return parity_of(config, overrides, run_dir, dp, output)


def lora_parity_run(config: Path, extra: list[str], run_dir: Path, nproc: int, dp: int, step: int = 2) -> Parity:
    """Train `step` steps of a LoRA `config` on `nproc` ranks with a dump at `step`, recompute it with peft.

    The dump is not at step 1: lora_B starts at zero, so lora_A's first gradient is zero and would
    compare nothing.
    """
    overrides = [
        f"train.steps={step}",
        f"debug.dump_step={step}",
        "checkpoint.every=0",
        f"data.path={run_dir / 'data'}",
        *extra,
    ]
    train(tiny_args(run_dir, *overrides, config=config), nproc=nproc)
    dump = dump_dir(run_dir, step)
    ref_loss, ref_grads, ref_norm = reference_step_from_dump(config, overrides, dump, dp=dp, step=step)
    metrics = read_metrics(run_dir)[step - 1]
    return Parity(
        metrics["loss"], ref_loss, metrics["grad_norm"], ref_norm, load_file(dump / "grads.safetensors"), ref_grads
    )


def dump_forward_inputs(dump: Path) -> dict[str, torch.Tensor]:
    """The forward arguments of a dump's first micro-batch (`m0.<arg>`), under the argument names."""
    from h3train.model.sp_forward import FORWARD_ARGS

    tensors = load_file(dump / "inputs.safetensors")
    return {name: tensors[f"m0.{name}"] for name in FORWARD_ARGS}


@torch.no_grad()
def forward_outputs(model, inputs: dict) -> torch.Tensor:
    """A diffusers model's video and audio predictions for `inputs`, flattened into one float64 vector."""
    video, audio = model(**inputs, return_dict=False)
    return torch.cat([video.flatten(), audio.flatten()]).double()


def relative_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    denom = b.double().norm()
    return float((a.double() - b.double()).norm() / denom) if denom > 0 else float(a.double().norm())
