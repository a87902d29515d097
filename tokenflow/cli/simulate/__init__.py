"""`tokenflow simulate`: the command (`command.py`) and its parts: the paper's GPU deployments
(`deployment.py`), a profile of this machine (`profile.py`), the policy's knobs (`policy.py`)
and fleets of replicas (`fleet.py`)."""

from tokenflow.cli.simulate.command import add_simulate_arguments, run_simulate

__all__ = ["add_simulate_arguments", "run_simulate"]
