import os
import sys
from pathlib import Path

import pytest

# Tests import their shared helpers (`reference`) as top-level modules.
sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture(autouse=True)
def _restore_diffusers_attention_backend():
    """`ModelMixin.set_attention_backend` also changes diffusers' process-wide default backend."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    active = _AttentionBackendRegistry._active_backend
    yield
    _AttentionBackendRegistry.set_active_backend(active)
