"""``python -m helios.doctor``: the same as ``helios-doctor``."""

import sys

from helios.doctor.cli import main

sys.exit(main())
