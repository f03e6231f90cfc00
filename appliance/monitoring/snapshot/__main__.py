import sys

from appliance.monitoring.snapshot.cli import main

sys.exit(main())
