"""The clocks live in the neutral `tokenflow.clock` (the real engine uses one too); re-exported
here so simulator code keeps reading `tokenflow.sim.clock`."""

from tokenflow.clock import SimClock, WallClock

__all__ = ["SimClock", "WallClock"]
