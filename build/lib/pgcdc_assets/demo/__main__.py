"""``python -m pgcdc_assets.demo``: run the demo (see the package docstring)."""

import sys

from pgcdc_assets.demo.run import main

sys.exit(main())
