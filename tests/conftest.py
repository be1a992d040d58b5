import os
import sys
from pathlib import Path

# Tests import their shared helpers (`reference`) as top-level modules.
sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
