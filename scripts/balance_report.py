"""How evenly the DP ranks work, unpacked against packed and balanced, from the checkout:
`h3train.tools.balance_report`, whose docstring says what it runs and measures.

.venv/bin/python scripts/balance_report.py --help
"""

import sys
from pathlib import Path

try:
    import h3train  # noqa: F401
except ImportError:  # a plain checkout without the editable install
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from h3train.tools.balance_report import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
