"""Step efficiency and memory of h3train on the CPU, from the checkout:
`h3train.tools.step_report`, whose docstring says what it runs and measures.

.venv/bin/python scripts/step_report.py --help
"""

import sys
from pathlib import Path

try:
    import h3train  # noqa: F401
except ImportError:  # a plain checkout without the editable install
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from h3train.tools.step_report import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
