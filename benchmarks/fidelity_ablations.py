"""What each thing the profiled simulator charges is worth: benchmarks/fidelity.py's predictions
again with one of them taken out, and the median errors that result."""

from __future__ import annotations

from dataclasses import replace

from tokenflow.calibrate.costs import fit_compute, point_medians
from tokenflow.calibrate.profile_file import Profile, PromptTokens

ABLATIONS = {
    "template": "prompts as the client's word counts (no chat template tokens)",
    "serving": "no engine or serving-path time per step or request (forward pass, scheduler)",
    "threads": "one line for every step (no one-thread regime for small steps)",
    "chunking": "whole prompts in one step (no chunk budget from --step-target-ms)",
    "anchoring": "each run on the profile before it only, as swept (no bracketing in time)",
}
# Deployment overrides an ablation needs (ProfiledDeployment fields).
DEPLOYMENT = {"chunking": {"step_target_ms": 1e9}}


def ablated(profile: Profile, name: str | None) -> Profile:
    """`profile` without what `name` takes out (unchanged for None and deployment ablations)."""
    if name == "template":
        words = PromptTokens(fixed_tokens=0.0, per_word=1.0)
        return replace(profile, prompt={k: words for k in profile.prompt})
    if name == "serving":
        served = {"server_step_s": 0.0, "server_per_chunk_s": 0.0, "request_path_s": 0.0}
        return replace(profile, costs=replace(profile.costs, **served))
    if name == "threads":
        compute = [s for s in point_medians(profile.samples) if s.num_tokens]
        one = fit_compute(compute)
        return replace(profile, costs=replace(profile.costs, serial=one, parallel=one))
    if name == "anchoring":
        as_swept = replace(profile.costs, speed_factor=1.0, prefill_speed_factor=1.0)
        return replace(profile, costs=as_swept)
    return profile
