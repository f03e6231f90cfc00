import sys

from appliance.monitoring.dashboards.write import main

sys.exit(main())
