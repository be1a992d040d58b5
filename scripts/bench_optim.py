"""The optimizer-state kinds and LoRA's frozen bases on the CPU bench model, from the checkout:
`h3train.tools.bench_optim`, whose docstring says what it runs and measures.

.venv/bin/python scripts/bench_optim.py --help
"""

import sys
from pathlib import Path

# A checkout without the editable install runs its own package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from h3train.tools.bench_optim import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
