"""Pipeline parallelism: schedules as data, tick tables, and the shard_map executor.

Nothing here imports model code: the executor runs `StageFunctions` given by the caller.
"""

from jaxmeg.pipeline.analysis import ScheduleError, lockstep_efficiency, validate
from jaxmeg.pipeline.schedules import Schedule, build
from jaxmeg.pipeline.tick_table import TickTable, build_tick_table
from jaxmeg.pipeline.timing import bubble_fraction

__all__ = [
    "Schedule",
    "ScheduleError",
    "TickTable",
    "bubble_fraction",
    "build",
    "build_tick_table",
    "lockstep_efficiency",
    "validate",
]
