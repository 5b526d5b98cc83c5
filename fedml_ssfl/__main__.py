"""``python -m fedml_ssfl``: the ``fedml-ssfl`` command (:mod:`fedml_ssfl.cli`), e.g. from a checkout not installed."""

import sys

from .cli import main

sys.exit(main())
