"""Pipeline parallelism: one worker's model split by layers over a group of devices (stages)."""
