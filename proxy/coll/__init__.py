"""Collectives: chunk schedules and their execution (run by the progress process)."""
