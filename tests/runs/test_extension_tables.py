"""The extension tables (adapter kinds, optimizer kinds, data sources, attention backends, conditioning
kinds): the config's choices are the tables', and a kind registered from outside the package
(a few lines here) trains, resumes and exports like a built-in one.

The outside kinds: rsLoRA (an adapter kind: LoRA with peft's `use_rslora`, output scale `alpha / sqrt(r)`),
AMSGrad (an optimizer kind: `torch.optim.AdamW(amsgrad=True)`, a third moment of float32 state) and a
first-frame conditioning kind (its own field, laid out and encoded by the entry's builder and recipe).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from peft.tuners.tuners_utils import BaseTunerLayer

from h3train import config
from h3train.cli import main
from h3train.config import load_config, schema
from h3train.data import source
from h3train.errors import ConfigError
from h3train.lora import adapter_kinds
from h3train.lora.files import DIFFUSERS_WEIGHT_NAME
from h3train.model.architecture import model_dims
from h3train.ops import attention
from h3train.optim import kinds as optim
from h3train.plan import checkpoint_bytes
from h3train.tasks import conditioning
from h3train.tasks import table as task_table

from helpers.launch import (
    checkpoint_dir,
    checkpoint_tensor_bytes,
    checkpoint_tensors,
    dump_dir,
    read_metrics,
    tiny_args,
)
from helpers.paths import ROOT
from helpers.reference import dump_forward_inputs, forward_outputs, peft_model_from_dump, relative_l2

TINY_LORA = ROOT / "configs" / "tiny_lora.yaml"


# -- the outside kinds: what a user writes ----------------------------------------------------------


class RsLoraKind(adapter_kinds.LoraKind):
    name = "rslora"
    label = "rsLoRA"
    reads_init_from = False  # a LoRA file's scale is alpha / r

    def selected_by(self, lora: Any) -> bool:
        return lora.kind == self.name

    def matches(self, record: dict) -> bool:
        return super().matches(record) and bool(record.get("use_rslora"))

    def peft_config(self, lora: Any, targets: list[str], alpha: float) -> Any:
        peft_config = super().peft_config(lora, targets, alpha)
        peft_config.use_rslora = True
        return peft_config


class AmsgradKind(optim.OptimizerKind):
    name = "adamw_amsgrad"

    def build(self, groups: list[dict], hyper: dict, cfg: Any, seed: int) -> torch.optim.Optimizer:
        return torch.optim.AdamW(groups, amsgrad=True, **hyper)

    def state_bytes_per_value(self) -> float:
        return 12.0  # exp_avg, exp_avg_sq, max_exp_avg_sq


# -------------------------------------------------------------------------------------------------------


def test_config_choices_are_the_tables() -> None:
    assert config.choices("lora.kind") == adapter_kinds.kind_choices() == ("lora", "lokr", "loha")
    assert config.choices("optim.name") == tuple(optim.OPTIMIZER_KINDS)
    assert set(adapter_kinds.ADAPTER_KINDS) == {"lora", "dora", "lokr", "loha"}
    assert config.choices("model.attention_backend") == attention.CONFIG_CHOICES
    assert config.choices("data.source") == tuple(source.DATA_SOURCES) == ("synthetic", "cached")


@pytest.fixture(scope="module")
def registered() -> Iterator[None]:
    """The outside kinds in the tables for this module's tests; the tables as they were afterwards."""
    saved = (dict(adapter_kinds.ADAPTER_KINDS), dict(optim.OPTIMIZER_KINDS), dict(schema._CHOICES))
    adapter_kinds.register_adapter_kind(RsLoraKind())
    optim.register_optimizer_kind(AmsgradKind())
    yield
    for table, before in zip((adapter_kinds.ADAPTER_KINDS, optim.OPTIMIZER_KINDS, schema._CHOICES), saved, strict=True):
        table.clear()
        table.update(before)


def test_an_unregistered_kind_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="config key 'lora.kind' is 'rslora'; choose one of lora, lokr, loha"):
        load_config(TINY_LORA, ["lora.kind=rslora"])
    with pytest.raises(ConfigError, match="config key 'optim.name' is 'adamw_amsgrad'"):
        load_config(TINY_LORA, ["optim.name=adamw_amsgrad"])


KINDS = ["lora.kind=rslora", "optim.name=adamw_amsgrad"]
RUN = ["train.steps=3", "train.grad_accum=1", "checkpoint.every=1", "checkpoint.keep_last=0", "optim.lr=2.0e-2"]


class Runs:
    def __init__(self, root: Path) -> None:
        self.root = root

    def train(self, name: str, *extra: str) -> Path:
        run = self.root / name
        assert main(tiny_args(run, *RUN, *KINDS, f"data.path={self.root / 'data'}", *extra, config=TINY_LORA)) == 0
        return run


@pytest.fixture(scope="module")
def runs(registered, tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("outside_kinds"))


@pytest.fixture(scope="module")
def trained(runs: Runs) -> Path:
    return runs.train("sp1", "debug.dump_step=3")


def test_outside_kinds_train_with_their_own_state(registered, trained: Path) -> None:
    cfg = load_config(TINY_LORA, KINDS)
    assert cfg.lora.kind == "rslora" and cfg.optim.name == "adamw_amsgrad"
    assert adapter_kinds.config_kind(cfg.lora).label == "rsLoRA"
    rows = [m for m in read_metrics(trained) if m.get("kind") is None]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    ckpt = checkpoint_dir(trained, 3)
    record = json.loads((ckpt / "trainer_state.json").read_text())["lora"]
    assert record["peft_type"] == "LORA" and record["use_rslora"] is True
    assert adapter_kinds.record_kind(record).name == "rslora"
    state = checkpoint_tensors(ckpt, "optim.state.")
    model = checkpoint_tensors(ckpt, "model.")
    assert any(k.endswith("max_exp_avg_sq") for k in state), "the AMSGrad moment is not in the checkpoint"
    # The plan counts the kind's state from its table entry: 4 bytes of weights + 12 of state per value.
    planned, held = checkpoint_bytes(model_dims(cfg), cfg), checkpoint_tensor_bytes(ckpt)
    assert planned == 16 * sum(v.numel() for v in model.values())
    assert 0 <= held - planned <= 0.01 * planned, (held, planned)
    # rsLoRA's scale, alpha / sqrt(r), is what the trained layers compute with.
    scales = {
        m.scaling["default"]
        for m in peft_model_from_dump(dump_dir(trained, 3)).modules()
        if isinstance(m, BaseTunerLayer)
    }
    assert scales == {cfg.lora.alpha / cfg.lora.rank**0.5}


def test_outside_kinds_resume_bitwise_and_refuse_another_kind(
    registered, runs: Runs, trained: Path, capsys: pytest.CaptureFixture
) -> None:
    resumed = runs.train("resumed", f"checkpoint.resume={checkpoint_dir(trained, 2)}")
    steps = [[m["step"], m["loss"], m["grad_norm"]] for m in read_metrics(trained) if m.get("kind") is None]
    assert [[m["step"], m["loss"], m["grad_norm"]] for m in read_metrics(resumed) if m.get("kind") is None] == steps[2:]
    for prefix in ("model.", "optim.state."):
        a = checkpoint_tensors(checkpoint_dir(resumed, 3), prefix)
        b = checkpoint_tensors(checkpoint_dir(trained, 3), prefix)
        assert a.keys() == b.keys() and a and all(torch.equal(a[k], b[k]) for k in a), prefix
    capsys.readouterr()
    resume = f"checkpoint.resume={checkpoint_dir(trained, 2)}"
    args = tiny_args(runs.root / "plain", *RUN, resume, "optim.name=adamw_amsgrad", config=TINY_LORA)
    assert main([*args, f"data.path={runs.root / 'data'}"]) == 2
    assert "holds adapters of another kind: lora.kind=rslora -> lora.kind=lora" in capsys.readouterr().err


def test_outside_adapter_kind_exports_what_it_trained(registered, trained: Path, tmp_path: Path) -> None:
    """diffusers' loader, reading the export's metadata, rebuilds the rsLoRA the run trained; so does --merge."""
    dump = dump_dir(trained, 3)  # the weights of the checkpoint at step 2
    model = peft_model_from_dump(dump).eval()
    inputs = dump_forward_inputs(dump)
    want = forward_outputs(model, inputs)
    assert main(["export", str(checkpoint_dir(trained, 2)), "--out", str(tmp_path / "lora")]) == 0
    base = model.__class__(**dict(model.config))
    named = {n.replace(".base_layer", ""): p for n, p in model.named_parameters()}
    base.load_state_dict({k: named[k].detach().clone() for k in base.state_dict()}, strict=True)
    base = base.float().eval()
    assert relative_l2(forward_outputs(base, inputs), want) > 1e-4, "the adapters changed nothing"
    base.load_lora_adapter(str(tmp_path / "lora"), weight_name=DIFFUSERS_WEIGHT_NAME, prefix="transformer")
    assert relative_l2(forward_outputs(base, inputs), want) <= 1e-6
    assert main(["export", str(checkpoint_dir(trained, 2)), "--out", str(tmp_path / "merged"), "--merge"]) == 0
    merged = model.__class__.from_pretrained(str(tmp_path / "merged")).float().eval()
    assert relative_l2(forward_outputs(merged, inputs), want) <= 1e-5


def test_every_conditioning_kind_has_its_task_encoder_and_request_field() -> None:
    """The conditioning kinds, the sample tasks that take them, the encoder's recipes and the request fields agree."""
    from h3train.config.schema import SAMPLE_FIELDS
    from h3train.encode.clip import conditioning_recipe
    from h3train.encode.manifest import ManifestEntry
    from h3train.render.requests import SampleRequest
    from h3train.tasks.conditioning import CONDITIONING_KINDS
    from h3train.tasks.table import SAMPLE_TASKS

    taken = {t.conditioning for t in SAMPLE_TASKS.values()} - {None}
    assert set(CONDITIONING_KINDS) == taken
    assert set(CONDITIONING_KINDS) <= set(SAMPLE_FIELDS)
    for name, kind in CONDITIONING_KINDS.items():
        assert kind.field == name and SAMPLE_TASKS[kind.sample_task].conditioning == name
        assert name in ManifestEntry.__dataclass_fields__ and name in SampleRequest.__dataclass_fields__
        assert conditioning_recipe(kind).__module__ == "h3train.encode.clip"


# -- an outside conditioning kind: the clip's own first frame under a field of its own -----------------


class FirstFrameKind(conditioning.KeyframesKind):
    field = "first_frame"
    encoder = f"{__name__}:encode_first_frame"

    def __init__(self) -> None:
        self.layouts = 0

    def build_layout(self, text_token_tags: torch.Tensor, geometry: Any, fields: Any, patch_size: Any) -> Any:
        self.layouts += 1
        return super().build_layout(text_token_tags, geometry, fields, patch_size)


def encode_first_frame(pipe: Any, entry: Any, settings: Any, frames: Any) -> tuple[dict[str, Any], str]:
    return {"keyframe_anchors": ("first",), "keyframes": (frames[:1],)}, f"prompts of a {entry.task} clip"


@pytest.fixture
def first_frame() -> Iterator[FirstFrameKind]:
    """The outside kind and a sample task taking it, for one test; the tables as they were afterwards."""
    saved = dict(conditioning.CONDITIONING_KINDS), dict(task_table.SAMPLE_TASKS)
    kind = conditioning.register_conditioning_kind(FirstFrameKind())
    task_table.SAMPLE_TASKS["ff2va"] = task_table.SampleTask(
        "ff2va", "transformer", "MiniMaxH3FL2VACoreDenoiseStep", kind.field
    )
    yield kind
    for live, before in zip((conditioning.CONDITIONING_KINDS, task_table.SAMPLE_TASKS), saved, strict=True):
        live.clear()
        live.update(before)


def test_an_outside_conditioning_kind_is_one_registration(first_frame: FirstFrameKind) -> None:
    """Its sample task is laid out by its builder and encoded by its recipe, which the entry names."""
    from h3train.encode.clip import encode_conditioning
    from h3train.tasks.layout import Geometry
    from h3train.tasks.sample import build_layout

    assert conditioning.conditioning_of("ff2va") is first_frame and first_frame.sample_task == "ff2va"
    tags, geometry = torch.ones(7, dtype=torch.long), Geometry(7, 4, 6, 10)
    layout = build_layout("ff2va", tags, geometry, ("first",))
    assert first_frame.layouts == 1
    assert torch.equal(layout.position_ids, build_layout("fl2va", tags, geometry, ("first",)).position_ids)
    frames = torch.zeros(5, 8, 8, 3)
    fields, prompts = encode_conditioning(None, SimpleNamespace(task="ff2va"), None, frames)
    assert fields["keyframe_anchors"] == ("first",) and prompts == "prompts of a ff2va clip"
    with pytest.raises(ValueError, match="conditioning kind 'first_frame' is already registered"):
        conditioning.register_conditioning_kind(FirstFrameKind())
