"""The cluster planner: hardware profiles (shipped datasheets, or `fivefold calibrate` measuring this
machine) that the memory plan and the speed model read."""
