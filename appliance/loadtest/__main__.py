"""``python -m appliance.loadtest plan|bench|capacity ...``: the same commands as ``appliance``."""

import sys

from appliance.loadtest.cli import main

if __name__ == "__main__":
    sys.exit(main())
