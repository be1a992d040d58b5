"""Checkpoints of the whole training state with `torch.distributed.checkpoint`, committed atomically.

Layout of `checkpoint.dir`:

    step_00000012/           a committed checkpoint (only committed ones carry this name)
      .metadata, *.distcp    DCP: every component of the checkpoint state, sharded
      trainer_state.json     step, commit number, model config, resolved config, a digest of every
                             file (JSON, for people and for the checks that run before a model exists)
    .h3train.lock            the lock of the run writing here (`h3train/infra/runlock.py`)
    .tmp-step_00000013/      being written; renamed to step_00000013 once every rank is done
    step_00000014.corrupt    a checkpoint that failed to load, set aside by a resume (never read)
    step_00000020.abandoned-12   a later checkpoint set aside when a run resumed from step 12

A checkpoint is valid only once it has its final name: the rename is the commit, done by rank 0 once
every rank's write is complete (after a barrier; a background save, as soon as DCP reports it done).
`.tmp-*` folders are never read. Each carries its writer's marker (`runlock.mark_owned`); at start the
run, holding the folder's lock, removes those of writers that stopped, and nothing without the marker.
The checkpoint state is one dict of named `Stateful` components (`run.parts.checkpoint_components`):
the model, the optimizer, the LR schedule position, the sampler, the step counters, the best
validation value, each step hook with state (the EMA). Tensors are keyed by their FQN, so
DCP reshards on load: a run resumes under another `dp_shard` / `sp` / `dp_replicate`.

A LoRA run's `model` component holds the trainable parameters only (`ModelState(trainable_only=True)`:
adapters and `lora.train_modules`, no frozen base weight); its `trainer_state.json` adds the
adapter's peft config (`lora`) and the base it was trained on (`lora_base`, `h3train/lora/base.py`).

The digests (`h3train/infra/digest.py`) are taken at commit, each rank reading back the shard files it
wrote; before a resume the ranks check them in parallel (`verify_file_digests`), and a file whose bytes
changed takes the corrupt-checkpoint path (set aside, the next older one used); export checks them too.

Commit order is recorded, not inferred: each commit writes `commit` (one more than any checkpoint
in the folder) into `trainer_state.json`, so a run folder copied elsewhere (new mtimes) keeps it.
"""

from __future__ import annotations

from .folders import (
    DIGESTS_FIELD,
    METADATA_FILE,
    MODEL_PREFIX,
    RUN_CHECKPOINTS,
    STATE_FILE,
    STEP_DIR,
    checkpoint_root,
    committed_checkpoints,
    is_complete,
    read_trainer_state,
    size_on_disk,
    step_dir_name,
    step_of,
)
from .staging import HostStaging
from .states import AttributeState, ModelState, OptimizerState, ScheduleState
from .verify import (
    CorruptCheckpoint,
    NamingReader,
    UnreadableFile,
    check_components,
    complete_checkpoints,
    file_digest_problem,
    read_components,
    read_failure_reason,
    validate_checkpoint,
    verify_file_digests,
)
from .writer import Checkpointer, room_needed

__all__ = [
    "STEP_DIR",
    "STATE_FILE",
    "METADATA_FILE",
    "MODEL_PREFIX",
    "step_dir_name",
    "step_of",
    "is_complete",
    "RUN_CHECKPOINTS",
    "checkpoint_root",
    "size_on_disk",
    "committed_checkpoints",
    "DIGESTS_FIELD",
    "read_trainer_state",
    "complete_checkpoints",
    "validate_checkpoint",
    "file_digest_problem",
    "verify_file_digests",
    "CorruptCheckpoint",
    "UnreadableFile",
    "NamingReader",
    "check_components",
    "read_components",
    "read_failure_reason",
    "ModelState",
    "OptimizerState",
    "ScheduleState",
    "AttributeState",
    "room_needed",
    "HostStaging",
    "Checkpointer",
]
