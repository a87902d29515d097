"""Calibration data: the sweep of step shapes, the costs fitted to it, the profile file that
carries them, and the facts of the machine it was taken on."""
