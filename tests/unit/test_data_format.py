"""The cached-sample format: round trip, one-line errors naming file and field, atomic writes, index."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import h3train.data.sample_file as fmt
import h3train.infra.atomic as atomic
from h3train.data.dataset_index import read_index, write_index
from h3train.data.sample_file import METADATA_KEY, CachedSample, read_cached_sample, read_sample, write_sample
from h3train.data.synthetic_dataset import synthetic_sample
from h3train.errors import DatasetError, SampleError

# ref2va sample 4 of the synthetic cycle: audio, video with soundtrack, image, silent video, image.
MIXED_REFS = 4


def _sample(task: str = "ref2va", index: int = MIXED_REFS) -> CachedSample:
    return synthetic_sample(task, index, seed=1, text_dim=8)


def _write_raw(path: Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Write a file the way a buggy encoder might, bypassing `write_sample`'s validation."""
    payload = {k: v.contiguous().clone() for k, v in tensors.items()}
    save_file(payload, str(path), metadata={METADATA_KEY: json.dumps(meta)})


def _expect_error(path: Path, field: str, *fragments: str) -> SampleError:
    with pytest.raises(SampleError) as info:
        read_sample(path)
    message = str(info.value)
    assert "\n" not in message
    assert f"sample '{path}'" in message and f"field '{field}'" in message, message
    for fragment in fragments:
        assert fragment in message, message
    return info.value


def test_round_trip_keeps_every_tensor_and_the_metadata(tmp_path: Path) -> None:
    sample = _sample()
    path = tmp_path / "s.safetensors"
    write_sample(path, sample)
    back = read_cached_sample(path)
    assert back.metadata() == sample.metadata()
    assert back.tensors().keys() == sample.tensors().keys()
    for name, tensor in sample.tensors().items():
        assert torch.equal(back.tensors()[name], tensor), name
    packed = read_sample(path)
    assert packed.sample_id == sample.sample_id and packed.task == "ref2va"
    assert [(r.kind, r.has_audio) for r in packed.references] == [(r.kind, r.has_audio) for r in sample.references]
    assert packed.negative_visual_text_token_tags is not None


@pytest.mark.parametrize("task,index", [("fl2va", 2), ("fl2va", 3), ("ref2va", 1), ("ref2va", 2)])
def test_round_trip_each_task(task: str, index: int, tmp_path: Path) -> None:
    sample = _sample(task, index)
    write_sample(tmp_path / "s.safetensors", sample)
    packed = read_sample(tmp_path / "s.safetensors")
    assert packed.layout.seq_len == fmt.read_header(tmp_path / "s.safetensors").seq_len()
    assert torch.equal(packed.prompt_embeds, sample.prompt_embeds)


def test_wrong_shape_names_file_and_field(tmp_path: Path) -> None:
    sample = _sample()
    tensors = sample.tensors()
    tensors["video_latents"] = tensors["video_latents"][:23]
    path = tmp_path / "bad_shape.safetensors"
    _write_raw(path, tensors, sample.metadata())
    _expect_error(path, "video_latents", "has shape [23,", "expected [24, F, H, W]")


def test_inconsistent_text_length_names_the_other_field(tmp_path: Path) -> None:
    sample = _sample()
    tensors = sample.tensors()
    tensors["text_token_tags"] = tensors["text_token_tags"][:-1]
    path = tmp_path / "bad_len.safetensors"
    _write_raw(path, tensors, sample.metadata())
    _expect_error(path, "text_token_tags", "(from 'prompt_embeds')")


def test_nan_names_file_and_field(tmp_path: Path) -> None:
    sample = _sample()
    tensors = sample.tensors()
    tensors["ref.1.audio"] = tensors["ref.1.audio"].clone()
    tensors["ref.1.audio"][0, 0, 0] = float("nan")
    path = tmp_path / "nan.safetensors"
    _write_raw(path, tensors, sample.metadata())
    _expect_error(path, "ref.1.audio", "non-finite")


@pytest.mark.parametrize(
    ("field", "values", "dtype"),
    [
        ("video_latents", [float("inf")], torch.float32),
        ("keyframe.0", [-float("inf")], torch.float32),
        # inf + (-inf) is NaN: the one-reduction check still sees it.
        ("audio_latents", [float("inf"), -float("inf"), float("nan")], torch.float32),
        ("prompt_embeds", [float("nan"), float("nan")], torch.bfloat16),
    ],
)
def test_non_finite_values_are_counted_and_named(field: str, values: list[float], dtype, tmp_path: Path) -> None:
    sample = _sample("fl2va", 2)
    tensors = sample.tensors()
    bad = tensors[field].to(dtype).clone()
    bad.view(-1)[: len(values)] = torch.tensor(values, dtype=dtype)
    tensors[field] = bad
    path = tmp_path / "bad.safetensors"
    _write_raw(path, tensors, sample.metadata())
    _expect_error(path, field, f"holds {len(values)} non-finite values")


@pytest.mark.parametrize("tag", [2, -1])
def test_tags_other_than_0_and_1_are_named(tag: int, tmp_path: Path) -> None:
    sample = _sample()
    tensors = sample.tensors()
    tensors["negative_text_token_tags"] = tensors["negative_text_token_tags"].clone()
    tensors["negative_text_token_tags"][-1] = tag
    path = tmp_path / "tags.safetensors"
    _write_raw(path, tensors, sample.metadata())
    _expect_error(path, "negative_text_token_tags", "tags other than 0 (vision) and 1 (text)")


def test_finite_values_whose_sum_overflows_still_load(tmp_path: Path) -> None:
    sample = _sample("fl2va", 2)
    sample.prompt_embeds = torch.full_like(sample.prompt_embeds, 3e38)
    assert not torch.isfinite(sample.prompt_embeds.sum())
    path = tmp_path / "big.safetensors"
    write_sample(path, sample)
    assert torch.equal(read_cached_sample(path).prompt_embeds, sample.prompt_embeds)


def test_a_clean_sample_is_checked_by_reductions_without_an_element_scan(tmp_path: Path, monkeypatch) -> None:
    """The element-wise scan (a bool tensor per field) runs only for a field whose reduction fails."""
    path = tmp_path / "s.safetensors"
    write_sample(path, _sample())
    scanned: list[tuple[int, ...]] = []
    isfinite = torch.isfinite

    def recording(t: torch.Tensor) -> torch.Tensor:
        scanned.append(tuple(t.shape))
        return isfinite(t)

    monkeypatch.setattr(torch, "isfinite", recording)
    read_sample(path)
    assert scanned and all(shape == () for shape in scanned), scanned


@pytest.mark.parametrize("field", ["negative_prompt_embeds", "ref.1.audio", "ref.2.video"])
def test_missing_field_names_file_and_field(field: str, tmp_path: Path) -> None:
    sample = _sample()
    tensors = sample.tensors()
    del tensors[field]
    path = tmp_path / "missing.safetensors"
    _write_raw(path, tensors, sample.metadata())
    _expect_error(path, field, "is missing")


def test_metadata_disagreeing_with_tensors_is_rejected(tmp_path: Path) -> None:
    sample = _sample()
    meta = sample.metadata()
    meta["num_frames"] = 39 if sample.num_frames != 39 else 22
    path = tmp_path / "frames.safetensors"
    _write_raw(path, sample.tensors(), meta)
    _expect_error(path, "video_latents", f"for num_frames={meta['num_frames']}")

    meta = sample.metadata()
    meta["references"][0]["kind"] = "image"
    _write_raw(path, sample.tensors(), meta)
    _expect_error(path, "metadata.references[0]", "has_audio=False")


def test_file_without_metadata_or_not_safetensors(tmp_path: Path) -> None:
    path = tmp_path / "plain.safetensors"
    save_file({"video_latents": torch.zeros(1)}, str(path))
    _expect_error(path, "metadata", "is missing")
    path.write_bytes(b"not a safetensors file")
    with pytest.raises(SampleError, match="not a readable safetensors file"):
        read_sample(path)


def test_writer_validates_before_writing(tmp_path: Path) -> None:
    sample = _sample()
    sample.prompt_embeds = sample.prompt_embeds.clone()
    sample.prompt_embeds[0, 0] = float("inf")
    path = tmp_path / "never.safetensors"
    with pytest.raises(SampleError, match="field 'prompt_embeds'"):
        write_sample(path, sample)
    assert list(tmp_path.iterdir()) == []


def test_atomic_write_never_exposes_a_partial_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "s.safetensors"
    old = _sample("fl2va", 0)
    write_sample(path, old)
    original = path.read_bytes()
    real_save = atomic.save_file
    written_to = []

    def save_then_crash(tensors: dict, filename: str, metadata: dict) -> None:
        written_to.append(Path(filename))
        real_save(tensors, filename, metadata=metadata)
        Path(filename).write_bytes(Path(filename).read_bytes()[:100])  # a torn write
        raise OSError("disk full")

    monkeypatch.setattr(atomic, "save_file", save_then_crash)
    with pytest.raises(OSError, match="disk full"):
        write_sample(path, _sample())
    assert written_to and written_to[0].parent == tmp_path and written_to[0].name != path.name
    assert path.read_bytes() == original  # the old sample is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.safetensors"]  # no temporary left


def test_index_round_trip_and_sequence_lengths(tmp_path: Path) -> None:
    sub = tmp_path / "part"
    sub.mkdir()
    for i in range(3):
        write_sample(sub / f"{i}.safetensors", _sample("ref2va", i))
    write_sample(tmp_path / "t.safetensors", _sample("fl2va", 3))
    entries = write_index(tmp_path)
    assert [e.file for e in entries] == [
        "part/0.safetensors",
        "part/1.safetensors",
        "part/2.safetensors",
        "t.safetensors",
    ]
    assert read_index(tmp_path) == entries
    for entry in entries:
        packed = read_sample(tmp_path / entry.file)
        assert entry.seq_len == packed.layout.seq_len
        assert entry.geometry == packed.geometry and entry.task == packed.task


def test_duplicate_sample_ids_are_rejected(tmp_path: Path) -> None:
    write_sample(tmp_path / "a.safetensors", _sample("ref2va", 0))
    write_sample(tmp_path / "b.safetensors", _sample("ref2va", 0))
    with pytest.raises(DatasetError, match="is used by both"):
        write_index(tmp_path)


@pytest.mark.parametrize("bad", ["../outside.safetensors", "/etc/passwd", "a/../../x.safetensors"])
def test_index_paths_must_stay_inside_the_folder(bad: str, tmp_path: Path) -> None:
    write_sample(tmp_path / "a.safetensors", _sample("ref2va", 0))
    [entry] = write_index(tmp_path)
    line = entry.to_json() | {"file": bad}
    (tmp_path / "index.jsonl").write_text(json.dumps(line) + "\n")
    with pytest.raises(DatasetError, match="line 1: file") as info:
        read_index(tmp_path)
    assert "\n" not in str(info.value)


def test_index_through_a_symlink_out_of_the_folder_is_rejected(tmp_path: Path) -> None:
    data, outside = tmp_path / "data", tmp_path / "outside"
    data.mkdir()
    outside.mkdir()
    (data / "link").symlink_to(outside, target_is_directory=True)
    line = {
        "id": "x",
        "file": "link/x.safetensors",
        "task": "t2va",
        "seq_len": 1,
        "has_audio": True,
        "geometry": {"num_latent_frames": 2, "latent_height": 4, "latent_width": 4, "num_audio_latents": 8},
    }
    (data / "index.jsonl").write_text(json.dumps(line) + "\n")
    with pytest.raises(DatasetError, match="outside the dataset folder"):
        read_index(data)


def test_malformed_or_missing_index(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=f"'{tmp_path}' has no index.jsonl"):
        read_index(tmp_path)
    with pytest.raises(DatasetError, match="does not exist"):
        read_index(tmp_path / "nope")
    (tmp_path / "index.jsonl").write_text('{"id": "x"}\n')
    with pytest.raises(DatasetError, match=r"line 1: malformed entry \(KeyError"):
        read_index(tmp_path)
